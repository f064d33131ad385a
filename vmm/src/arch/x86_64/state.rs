// SPDX-License-Identifier: Apache-2.0
//! Saving and loading the x86_64 KVM state of a paused VM: per vCPU
//! registers, special registers, xsave (FPU/SSE/AVX), XCRs, debug
//! registers, MSRs, the local APIC, pending events and the MP state; per
//! VM the in-kernel PIC pair, IOAPIC, PIT and kvmclock.
//!
//! The KVM structures are serialized through kvm-bindings' `serde`
//! feature (their raw bytes), so the layout is the kernel ABI's.

use kvm_bindings::{
    KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE,
    KVM_VCPUEVENT_VALID_NMI_PENDING, KVM_VCPUEVENT_VALID_SIPI_VECTOR, Msrs, kvm_clock_data,
    kvm_debugregs, kvm_irqchip, kvm_lapic_state, kvm_mp_state, kvm_msr_entry, kvm_pit_state2,
    kvm_regs, kvm_sregs, kvm_vcpu_events, kvm_xcrs, kvm_xsave,
};
use kvm_ioctls::{Cap, Kvm, VcpuFd, VmFd};
use serde::{Deserialize, Serialize};

/// Errors from reading or loading KVM state.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StateError {
    /// A KVM_GET_* ioctl failed.
    #[error("cannot read {what} of vCPU {vcpu}")]
    GetVcpu {
        /// vCPU index.
        vcpu: usize,
        /// The state that could not be read.
        what: &'static str,
        /// Cause.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// A KVM_SET_* ioctl failed.
    #[error("cannot load {what} into vCPU {vcpu}")]
    SetVcpu {
        /// vCPU index.
        vcpu: usize,
        /// The state that could not be loaded.
        what: &'static str,
        /// Cause.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// KVM took only part of the saved MSRs.
    #[error("vCPU {vcpu}: KVM refused MSR {index:#x} ({set} of {total} loaded)")]
    MsrRefused {
        /// vCPU index.
        vcpu: usize,
        /// The first MSR KVM did not take.
        index: u32,
        /// MSRs loaded before it.
        set: usize,
        /// MSRs in the state.
        total: usize,
    },
    /// Building an MSR list failed (more entries than KVM's limit).
    #[error("cannot build a list of {0} MSRs")]
    MsrList(usize),
    /// A VM-wide KVM_GET_* / KVM_SET_* ioctl failed.
    #[error("cannot {op} the VM's {what}")]
    Vm {
        /// `read` or `load`.
        op: &'static str,
        /// Which state.
        what: &'static str,
        /// Cause.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// The state does not hold the three irqchips (PIC, PIC, IOAPIC).
    #[error("the state holds {0} irqchips, not 3 (master PIC, slave PIC, IOAPIC)")]
    IrqchipCount(usize),
    /// The host's xsave area is larger than KVM_GET_XSAVE carries.
    #[error("the xsave area is {0} bytes; only 4096-byte areas (no AMX) are supported")]
    XsaveTooLarge(i32),
}

/// The state of one vCPU.
#[derive(Serialize, Deserialize)]
pub struct VcpuState {
    /// General-purpose registers.
    pub regs: kvm_regs,
    /// Segment, control and descriptor-table registers.
    pub sregs: kvm_sregs,
    /// FPU, SSE and AVX state (the legacy 4 KiB xsave area).
    pub xsave: kvm_xsave,
    /// Extended control registers (XCR0).
    pub xcrs: kvm_xcrs,
    /// Debug registers.
    pub debugregs: kvm_debugregs,
    /// Model-specific registers: every MSR KVM lists that reads back.
    pub msrs: Vec<kvm_msr_entry>,
    /// The in-kernel local APIC's registers.
    pub lapic: kvm_lapic_state,
    /// Pending exceptions, interrupts, NMIs and SIPIs.
    pub events: kvm_vcpu_events,
    /// Runnable, halted, waiting for SIPI, ...
    pub mp_state: kvm_mp_state,
}

impl std::fmt::Debug for VcpuState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VcpuState")
            .field("rip", &format_args!("{:#x}", self.regs.rip))
            .field("mp_state", &self.mp_state.mp_state)
            .field("msrs", &self.msrs.len())
            .finish_non_exhaustive()
    }
}

/// The VM-wide in-kernel devices and clock.
#[derive(Serialize, Deserialize)]
pub struct VmArchState {
    /// 8259 master, 8259 slave, IOAPIC (in that order).
    pub irqchips: Vec<kvm_irqchip>,
    /// The 8254 timer.
    pub pit: kvm_pit_state2,
    /// kvmclock.
    pub clock: kvm_clock_data,
}

impl std::fmt::Debug for VmArchState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VmArchState")
            .field("irqchips", &self.irqchips.len())
            .field("clock", &self.clock.clock)
            .finish_non_exhaustive()
    }
}

/// Refuses hosts whose xsave area does not fit `kvm_xsave`.
pub fn check_xsave(vm: &VmFd) -> Result<(), StateError> {
    let size = vm.check_extension_int(Cap::Xsave2);
    if size > 4096 {
        return Err(StateError::XsaveTooLarge(size));
    }
    Ok(())
}

/// The MSRs KVM lists (KVM_GET_MSR_INDEX_LIST) that `vcpu` can read back.
pub fn readable_msrs(kvm: &Kvm, vcpu: &VcpuFd) -> Result<Vec<u32>, StateError> {
    let list = kvm
        .get_msr_index_list()
        .map_err(|source| StateError::GetVcpu {
            vcpu: 0,
            what: "the MSR index list",
            source,
        })?;
    let mut readable = Vec::new();
    for &index in list.as_slice() {
        let mut one = Msrs::from_entries(&[kvm_msr_entry {
            index,
            ..Default::default()
        }])
        .map_err(|_| StateError::MsrList(1))?;
        if matches!(vcpu.get_msrs(&mut one), Ok(1)) {
            readable.push(index);
        }
    }
    Ok(readable)
}

/// Reads the state of vCPU `id` (paused, its last exit completed).
pub fn save_vcpu(vcpu: &VcpuFd, id: usize, msr_indices: &[u32]) -> Result<VcpuState, StateError> {
    let get = |what: &'static str| {
        move |source| StateError::GetVcpu {
            vcpu: id,
            what,
            source,
        }
    };
    let mp_state = vcpu.get_mp_state().map_err(get("the MP state"))?;
    let regs = vcpu.get_regs().map_err(get("registers"))?;
    let sregs = vcpu.get_sregs().map_err(get("special registers"))?;
    let xsave = vcpu.get_xsave().map_err(get("the xsave area"))?;
    let xcrs = vcpu.get_xcrs().map_err(get("XCRs"))?;
    let debugregs = vcpu.get_debug_regs().map_err(get("debug registers"))?;
    let lapic = vcpu.get_lapic().map_err(get("the local APIC"))?;
    let events = vcpu.get_vcpu_events().map_err(get("pending events"))?;
    let mut msrs = Vec::with_capacity(msr_indices.len());
    for chunk in msr_indices.chunks(MSR_CHUNK) {
        let entries: Vec<kvm_msr_entry> = chunk
            .iter()
            .map(|&index| kvm_msr_entry {
                index,
                ..Default::default()
            })
            .collect();
        let mut list =
            Msrs::from_entries(&entries).map_err(|_| StateError::MsrList(chunk.len()))?;
        let n = vcpu.get_msrs(&mut list).map_err(get("MSRs"))?;
        if n != chunk.len() {
            return Err(StateError::GetVcpu {
                vcpu: id,
                what: "MSRs",
                source: kvm_ioctls::Error::new(libc::EIO),
            });
        }
        msrs.extend_from_slice(list.as_slice());
    }
    Ok(VcpuState {
        regs,
        sregs,
        xsave,
        xcrs,
        debugregs,
        msrs,
        lapic,
        events,
        mp_state,
    })
}

/// Most MSRs per KVM_GET/SET_MSRS call.
const MSR_CHUNK: usize = 128;

/// Loads `state` into vCPU `id` (created, CPUID set, not running).
pub fn restore_vcpu(vcpu: &VcpuFd, id: usize, state: &VcpuState) -> Result<(), StateError> {
    let set = |what: &'static str| {
        move |source| StateError::SetVcpu {
            vcpu: id,
            what,
            source,
        }
    };
    // Order as in the kernel's selftests and other VMMs: the MP state and
    // registers, then the xsave area, the APIC before the MSRs (the TSC
    // deadline MSR needs the APIC's timer mode), and the events last.
    vcpu.set_mp_state(state.mp_state)
        .map_err(set("the MP state"))?;
    vcpu.set_regs(&state.regs).map_err(set("registers"))?;
    vcpu.set_sregs(&state.sregs)
        .map_err(set("special registers"))?;
    // SAFETY: `check_xsave` refused hosts whose xsave area is larger than
    // `kvm_xsave`, so KVM_SET_XSAVE reads only the struct passed.
    unsafe { vcpu.set_xsave(&state.xsave) }.map_err(set("the xsave area"))?;
    vcpu.set_xcrs(&state.xcrs).map_err(set("XCRs"))?;
    vcpu.set_debug_regs(&state.debugregs)
        .map_err(set("debug registers"))?;
    vcpu.set_lapic(&state.lapic)
        .map_err(set("the local APIC"))?;
    let total = state.msrs.len();
    let mut done = 0;
    for chunk in state.msrs.chunks(MSR_CHUNK) {
        let list = Msrs::from_entries(chunk).map_err(|_| StateError::MsrList(chunk.len()))?;
        let n = vcpu.set_msrs(&list).map_err(set("MSRs"))?;
        if n != chunk.len() {
            return Err(StateError::MsrRefused {
                vcpu: id,
                index: chunk.get(n).map_or(0, |e| e.index),
                set: done + n,
                total,
            });
        }
        done += n;
    }
    let mut events = state.events;
    events.flags |= KVM_VCPUEVENT_VALID_NMI_PENDING | KVM_VCPUEVENT_VALID_SIPI_VECTOR;
    vcpu.set_vcpu_events(&events)
        .map_err(set("pending events"))?;
    Ok(())
}

const CHIPS: [(u32, &str); 3] = [
    (KVM_IRQCHIP_PIC_MASTER, "master PIC"),
    (KVM_IRQCHIP_PIC_SLAVE, "slave PIC"),
    (KVM_IRQCHIP_IOAPIC, "IOAPIC"),
];

/// Reads the in-kernel irqchip, PIT and clock.
pub fn save_vm(vm: &VmFd) -> Result<VmArchState, StateError> {
    let get = |what: &'static str| {
        move |source| StateError::Vm {
            op: "read",
            what,
            source,
        }
    };
    let mut irqchips = Vec::new();
    for (chip_id, what) in CHIPS {
        let mut c = kvm_irqchip {
            chip_id,
            ..Default::default()
        };
        vm.get_irqchip(&mut c).map_err(get(what))?;
        irqchips.push(c);
    }
    let pit = vm.get_pit2().map_err(get("PIT"))?;
    let mut clock = vm.get_clock().map_err(get("clock"))?;
    // KVM_SET_CLOCK takes no flags it reported (TSC_STABLE, REALTIME, HOST_TSC).
    clock.flags = 0;
    Ok(VmArchState {
        irqchips,
        pit,
        clock,
    })
}

/// Loads the in-kernel irqchip, PIT and clock.
pub fn restore_vm(vm: &VmFd, state: &VmArchState) -> Result<(), StateError> {
    let set = |what: &'static str| {
        move |source| StateError::Vm {
            op: "load",
            what,
            source,
        }
    };
    if state.irqchips.len() != CHIPS.len() {
        return Err(StateError::IrqchipCount(state.irqchips.len()));
    }
    vm.set_pit2(&state.pit).map_err(set("PIT"))?;
    let mut clock = state.clock;
    clock.flags = 0;
    vm.set_clock(&clock).map_err(set("clock"))?;
    for (c, (chip_id, what)) in state.irqchips.iter().zip(CHIPS) {
        if c.chip_id != chip_id {
            return Err(StateError::Vm {
                op: "load",
                what,
                source: kvm_ioctls::Error::new(libc::EINVAL),
            });
        }
        vm.set_irqchip(c).map_err(set(what))?;
    }
    Ok(())
}
