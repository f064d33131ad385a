// SPDX-License-Identifier: Apache-2.0
//! x86_64 vCPU setup: GDT, identity page tables, long mode (or PVH's 32-bit
//! protected mode), CPUID, MSRs, FPU and the local APIC's LINT pins.

pub mod layout;
pub mod state;

use kvm_bindings::{
    CpuId, KVM_MAX_CPUID_ENTRIES, Msrs, kvm_fpu, kvm_msr_entry, kvm_regs, kvm_segment,
};
use kvm_ioctls::{Kvm, VcpuFd};
use vm_memory::{Bytes, GuestAddress};

use crate::memory::GuestMemory;

/// Errors from vCPU register setup.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ArchError {
    /// KVM_GET_SUPPORTED_CPUID failed.
    #[error("cannot read supported CPUID")]
    GetSupportedCpuid(#[source] kvm_ioctls::Error),
    /// KVM_SET_CPUID2 failed.
    #[error("cannot set CPUID")]
    SetCpuid(#[source] kvm_ioctls::Error),
    /// KVM_SET_MSRS failed or applied only some entries.
    #[error("cannot set MSRs")]
    SetMsrs(#[source] Option<kvm_ioctls::Error>),
    /// Building the MSR list failed.
    #[error("cannot build the MSR list")]
    BuildMsrs,
    /// KVM_SET_FPU failed.
    #[error("cannot set FPU state")]
    SetFpu(#[source] kvm_ioctls::Error),
    /// KVM_GET/SET_REGS failed.
    #[error("cannot set general-purpose registers")]
    SetRegs(#[source] kvm_ioctls::Error),
    /// KVM_GET/SET_SREGS failed.
    #[error("cannot set special registers")]
    SetSregs(#[source] kvm_ioctls::Error),
    /// KVM_GET/SET_LAPIC failed.
    #[error("cannot configure the local APIC")]
    SetLapic(#[source] kvm_ioctls::Error),
    /// Writing GDT or page tables into guest memory failed.
    #[error("cannot write boot structures to guest memory")]
    WriteGuestMemory(#[source] vm_memory::GuestMemoryError),
}

/// How the boot vCPU enters the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Entry {
    /// 64-bit long mode at `rip`, `boot_params` address in RSI.
    Linux64 {
        /// Entry address.
        rip: u64,
    },
    /// 32-bit protected mode at `rip`, `hvm_start_info` address in EBX.
    Pvh {
        /// Entry address.
        rip: u64,
    },
}

const X86_CR0_PE: u64 = 1 << 0;
const X86_CR0_MP: u64 = 1 << 1;
const X86_CR0_ET: u64 = 1 << 4;
const X86_CR0_NW: u64 = 1 << 29;
const X86_CR0_CD: u64 = 1 << 30;
const X86_CR0_PG: u64 = 1 << 31;
const X86_CR4_PAE: u64 = 1 << 5;
const X86_CR4_OSFXSR: u64 = 1 << 9;
const X86_CR4_OSXMMEXCPT: u64 = 1 << 10;
const EFER_LME: u64 = 1 << 8;
const EFER_LMA: u64 = 1 << 10;

/// A GDT descriptor from flags, base and limit (the Linux `GDT_ENTRY` macro).
pub const fn gdt_entry(flags: u16, base: u32, limit: u32) -> u64 {
    ((base as u64 & 0xff00_0000) << (56 - 24))
        | ((flags as u64 & 0x0000_f0ff) << 40)
        | ((limit as u64 & 0x000f_0000) << (48 - 16))
        | ((base as u64 & 0x00ff_ffff) << 16)
        | (limit as u64 & 0x0000_ffff)
}

fn segment_from_gdt(entry: u64, index: u8) -> kvm_segment {
    let g = ((entry >> 55) & 1) as u8;
    let raw_limit = ((entry & 0xffff) | ((entry >> 32) & 0xf_0000)) as u32;
    let present = ((entry >> 47) & 1) as u8;
    kvm_segment {
        base: ((entry >> 16) & 0xff_ffff) | ((entry >> 32) & 0xff00_0000),
        limit: if g == 1 {
            (raw_limit << 12) | 0xfff
        } else {
            raw_limit
        },
        selector: u16::from(index) * 8,
        type_: ((entry >> 40) & 0xf) as u8,
        present,
        dpl: ((entry >> 45) & 3) as u8,
        db: ((entry >> 54) & 1) as u8,
        s: ((entry >> 44) & 1) as u8,
        l: ((entry >> 53) & 1) as u8,
        g,
        avl: ((entry >> 52) & 1) as u8,
        unusable: u8::from(present == 0),
        padding: 0,
    }
}

/// Writes the 4-level identity map of the first 4 GiB (2 MiB pages).
pub fn setup_page_tables(mem: &GuestMemory) -> Result<(), ArchError> {
    mem.write_obj(PDPT_ENTRY, GuestAddress(layout::PML4_ADDR))
        .map_err(ArchError::WriteGuestMemory)?;
    for i in 0..4u64 {
        let pd = layout::PD_ADDR + i * 0x1000;
        mem.write_obj(pd | 0x3, GuestAddress(layout::PDPT_ADDR + i * 8))
            .map_err(ArchError::WriteGuestMemory)?;
        let mut table = [0u8; 4096];
        for (j, chunk) in table.chunks_exact_mut(8).enumerate() {
            let addr = (i << 30) | ((j as u64) << 21);
            // present | writable | page size (2 MiB)
            chunk.copy_from_slice(&(addr | 0x83).to_le_bytes());
        }
        mem.write_slice(&table, GuestAddress(pd))
            .map_err(ArchError::WriteGuestMemory)?;
    }
    Ok(())
}

const PDPT_ENTRY: u64 = layout::PDPT_ADDR | 0x3;

/// Reads the host's KVM-supported CPUID once; each vCPU gets a patched copy.
pub fn supported_cpuid(kvm: &Kvm) -> Result<CpuId, ArchError> {
    kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(ArchError::GetSupportedCpuid)
}

/// Patches CPUID for vCPU `id` of `count`: APIC ids, topology, hypervisor bit.
pub fn patch_cpuid(cpuid: &mut CpuId, id: u8, count: u8) {
    let bits = u32::BITS - u32::from(count.max(1) - 1).leading_zeros();
    for e in cpuid.as_mut_slice() {
        match e.function {
            1 => {
                e.ebx = (u32::from(id) << 24) | (u32::from(count) << 16) | (8 << 8);
                e.ecx |= 1 << 31; // running under a hypervisor
                if count > 1 {
                    e.edx |= 1 << 28; // HTT: the logical count field is valid
                }
            }
            4 => {
                // Intel: cores per package - 1 in EAX[31:26]; one thread per core.
                e.eax = (e.eax & 0x3fff) | ((u32::from(count) - 1) << 26);
            }
            0xb | 0x1f => {
                e.edx = u32::from(id);
                match e.index {
                    0 => {
                        e.eax = 0;
                        e.ebx = 1;
                        e.ecx = (1 << 8) | e.index;
                    }
                    1 => {
                        e.eax = bits;
                        e.ebx = u32::from(count);
                        e.ecx = (2 << 8) | e.index;
                    }
                    _ => {
                        e.eax = 0;
                        e.ebx = 0;
                        e.ecx = e.index;
                    }
                }
            }
            0x8000_0008 => {
                // AMD: NC = cores - 1, ApicIdSize.
                e.ecx = (bits << 12) | (u32::from(count) - 1);
            }
            _ => {}
        }
    }
}

fn msr(index: u32, data: u64) -> kvm_msr_entry {
    kvm_msr_entry {
        index,
        data,
        ..Default::default()
    }
}

/// Configures one vCPU. Every vCPU gets CPUID, MSRs, FPU and LAPIC setup;
/// only the boot vCPU (id 0) gets an entry point — application processors
/// wait for INIT/SIPI in the in-kernel LAPIC.
pub fn configure_vcpu(
    vcpu: &VcpuFd,
    mem: &GuestMemory,
    base_cpuid: &CpuId,
    id: u8,
    count: u8,
    entry: Option<Entry>,
) -> Result<(), ArchError> {
    let mut cpuid = base_cpuid.clone();
    patch_cpuid(&mut cpuid, id, count);
    vcpu.set_cpuid2(&cpuid).map_err(ArchError::SetCpuid)?;

    let entries = [
        msr(0x174, 0),               // IA32_SYSENTER_CS
        msr(0x175, 0),               // IA32_SYSENTER_ESP
        msr(0x176, 0),               // IA32_SYSENTER_EIP
        msr(0xc000_0081, 0),         // STAR
        msr(0xc000_0082, 0),         // LSTAR
        msr(0xc000_0083, 0),         // CSTAR
        msr(0xc000_0084, 0),         // SYSCALL_MASK
        msr(0xc000_0102, 0),         // KERNEL_GS_BASE
        msr(0x10, 0),                // TSC
        msr(0x1a0, 1),               // MISC_ENABLE: fast strings
        msr(0x2ff, (1 << 11) | 0x6), // MTRRdefType: enabled, write-back
    ];
    let msrs = Msrs::from_entries(&entries).map_err(|_| ArchError::BuildMsrs)?;
    let n = vcpu
        .set_msrs(&msrs)
        .map_err(|e| ArchError::SetMsrs(Some(e)))?;
    if n != entries.len() {
        return Err(ArchError::SetMsrs(None));
    }

    let fpu = kvm_fpu {
        fcw: 0x37f,
        mxcsr: 0x1f80,
        ..Default::default()
    };
    vcpu.set_fpu(&fpu).map_err(ArchError::SetFpu)?;

    setup_lint(vcpu)?;

    if let Some(entry) = entry {
        setup_boot_regs(vcpu, mem, entry)?;
    }
    Ok(())
}

/// LINT0 = ExtINT (the PIC), LINT1 = NMI, as firmware would leave them.
fn setup_lint(vcpu: &VcpuFd) -> Result<(), ArchError> {
    const APIC_LVT0: usize = 0x350;
    const APIC_LVT1: usize = 0x360;
    const MODE_EXTINT: u32 = 0x7;
    const MODE_NMI: u32 = 0x4;
    let mut lapic = vcpu.get_lapic().map_err(ArchError::SetLapic)?;
    for (off, mode) in [(APIC_LVT0, MODE_EXTINT), (APIC_LVT1, MODE_NMI)] {
        let bytes: [u8; 4] = std::array::from_fn(|i| lapic.regs[off + i] as u8);
        let v = u32::from_le_bytes(bytes);
        let v = (v & !0x700) | (mode << 8);
        for (i, b) in v.to_le_bytes().iter().enumerate() {
            lapic.regs[off + i] = *b as _;
        }
    }
    vcpu.set_lapic(&lapic).map_err(ArchError::SetLapic)
}

fn setup_boot_regs(vcpu: &VcpuFd, mem: &GuestMemory, entry: Entry) -> Result<(), ArchError> {
    let long = matches!(entry, Entry::Linux64 { .. });
    let code = if long {
        gdt_entry(0xa09b, 0, 0xfffff) // 64-bit code
    } else {
        gdt_entry(0xc09b, 0, 0xfffff) // 32-bit code
    };
    let gdt = [
        0,
        code,
        gdt_entry(0xc093, 0, 0xfffff), // data
        gdt_entry(0x808b, 0, 0xfffff), // TSS
    ];
    for (i, e) in gdt.iter().enumerate() {
        mem.write_obj(*e, GuestAddress(layout::GDT_ADDR + i as u64 * 8))
            .map_err(ArchError::WriteGuestMemory)?;
    }
    mem.write_obj(0u64, GuestAddress(layout::IDT_ADDR))
        .map_err(ArchError::WriteGuestMemory)?;

    let mut sregs = vcpu.get_sregs().map_err(ArchError::SetSregs)?;
    let data = segment_from_gdt(gdt[2], 2);
    sregs.gdt.base = layout::GDT_ADDR;
    sregs.gdt.limit = (gdt.len() * 8 - 1) as u16;
    sregs.idt.base = layout::IDT_ADDR;
    sregs.idt.limit = 7;
    sregs.cs = segment_from_gdt(gdt[1], 1);
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = segment_from_gdt(gdt[3], 3);
    sregs.cr0 = (sregs.cr0 & !(X86_CR0_CD | X86_CR0_NW)) | X86_CR0_PE | X86_CR0_ET;
    if long {
        setup_page_tables(mem)?;
        sregs.cr3 = layout::PML4_ADDR;
        sregs.cr4 |= X86_CR4_PAE | X86_CR4_OSFXSR | X86_CR4_OSXMMEXCPT;
        sregs.cr0 |= X86_CR0_PG | X86_CR0_MP;
        sregs.efer |= EFER_LME | EFER_LMA;
    } else {
        sregs.cr4 = 0;
        sregs.efer = 0;
    }
    vcpu.set_sregs(&sregs).map_err(ArchError::SetSregs)?;

    let regs = match entry {
        Entry::Linux64 { rip } => kvm_regs {
            rflags: 0x2,
            rip,
            rsp: layout::BOOT_STACK_TOP,
            rbp: layout::BOOT_STACK_TOP,
            rsi: layout::ZERO_PAGE_ADDR,
            ..Default::default()
        },
        Entry::Pvh { rip } => kvm_regs {
            rflags: 0x2,
            rip,
            rbx: layout::PVH_INFO_ADDR,
            ..Default::default()
        },
    };
    vcpu.set_regs(&regs).map_err(ArchError::SetRegs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gdt_entries_decode_to_segments() {
        let cs = segment_from_gdt(gdt_entry(0xa09b, 0, 0xfffff), 1);
        assert_eq!(cs.selector, 8);
        assert_eq!(cs.l, 1);
        assert_eq!(cs.type_, 0xb);
        assert_eq!(cs.limit, 0xffff_ffff);
        assert_eq!(cs.present, 1);
        let tss = segment_from_gdt(gdt_entry(0x808b, 0, 0xfffff), 3);
        assert_eq!(tss.s, 0);
        assert_eq!(tss.type_, 0xb);
        let null = segment_from_gdt(0, 0);
        assert_eq!(null.unusable, 1);
    }

    #[test]
    fn cpuid_patch_sets_apic_id_and_topology() {
        let mut c = CpuId::from_entries(&[
            kvm_bindings::kvm_cpuid_entry2 {
                function: 1,
                ..Default::default()
            },
            kvm_bindings::kvm_cpuid_entry2 {
                function: 0xb,
                index: 1,
                ..Default::default()
            },
        ])
        .unwrap();
        patch_cpuid(&mut c, 3, 4);
        let s = c.as_slice();
        assert_eq!(s[0].ebx >> 24, 3);
        assert_eq!((s[0].ebx >> 16) & 0xff, 4);
        assert_ne!(s[0].ecx & (1 << 31), 0);
        assert_eq!(s[1].edx, 3);
        assert_eq!(s[1].ebx, 4);
        assert_eq!(s[1].eax, 2);
    }
}
