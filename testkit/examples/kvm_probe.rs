// SPDX-License-Identifier: Apache-2.0
//! `kvm_probe`: a tiny KVM smoke test, built statically to run inside the
//! nested-KVM box (it runs on the host's KVM too).
//!
//! It creates a VM with 64 KiB of RAM and one vCPU in real mode running:
//!
//! ```text
//! mov dx, 0x3f8 ; mov al, 'K' ; out dx, al ; mov al, '\n' ; out dx, al
//! mov ax, 0x1000 ; mov ds, ax ; mov byte [0], 0x42      ; MMIO write at 0x10000
//! mov dx, 0x80 ; mov cx, N
//! loop: out dx, al ; dec cx ; jnz loop                   ; N port-I/O exits
//! hlt
//! ```
//!
//! and checks every exit. It prints `KVM_PROBE: ...` lines, ending with
//! `KVM_PROBE: OK exits=<n> exit_us=<mean µs per exit>`, and exits 0 on
//! success.
//!
//! Usage: `kvm_probe [--exits N]` (default 1000).

use std::process::ExitCode;
use std::time::Instant;

use kvm_bindings::kvm_userspace_memory_region;
use kvm_ioctls::{Kvm, VcpuExit};

const MEM_SIZE: usize = 0x1_0000;
const CODE_ADDR: u64 = 0x1000;

fn guest_code(loops: u16) -> Vec<u8> {
    let [lo, hi] = loops.to_le_bytes();
    vec![
        0xba, 0xf8, 0x03, // mov dx, 0x3f8
        0xb0, b'K', // mov al, 'K'
        0xee, // out dx, al
        0xb0, b'\n', // mov al, '\n'
        0xee,  // out dx, al
        0xb8, 0x00, 0x10, // mov ax, 0x1000
        0x8e, 0xd8, // mov ds, ax
        0xc6, 0x06, 0x00, 0x00, 0x42, // mov byte [0], 0x42
        0xba, 0x80, 0x00, // mov dx, 0x80
        0xb9, lo, hi,   // mov cx, loops
        0xee, // loop: out dx, al
        0x49, // dec cx
        0x75, 0xfc, // jnz loop
        0xf4, // hlt
    ]
}

fn main() -> ExitCode {
    let mut loops: u16 = 1000;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match (a.as_str(), args.next().and_then(|n| n.parse().ok())) {
            ("--exits", Some(n)) if n > 0 => loops = n,
            _ => {
                eprintln!("usage: kvm_probe [--exits N]  (1 <= N <= 65535)");
                return ExitCode::from(2);
            }
        }
    }
    match probe(loops) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            println!("KVM_PROBE: FAIL {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Anonymous guest memory, unmapped on drop.
struct GuestRam {
    ptr: *mut u8,
    len: usize,
}

impl GuestRam {
    fn new(len: usize) -> anyhow::Result<Self> {
        // SAFETY: an anonymous private mapping with no address hint; the
        // result is checked against MAP_FAILED before use.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        anyhow::ensure!(
            ptr != libc::MAP_FAILED,
            "mmap: {}",
            std::io::Error::last_os_error()
        );
        Ok(Self {
            ptr: ptr.cast(),
            len,
        })
    }

    fn write(&mut self, offset: usize, data: &[u8]) {
        assert!(offset + data.len() <= self.len);
        // SAFETY: the range was checked to lie inside the mapping, which is
        // owned by `self` and not aliased by any Rust reference.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(offset), data.len()) };
    }
}

impl Drop for GuestRam {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly the mapping created in `new`.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

fn probe(loops: u16) -> anyhow::Result<()> {
    let kvm = Kvm::new().map_err(|e| anyhow::anyhow!("open /dev/kvm: {e}"))?;
    println!(
        "KVM_PROBE: api_version={} max_vcpus={} vcpu_mmap_size={}",
        kvm.get_api_version(),
        kvm.get_max_vcpus(),
        kvm.get_vcpu_mmap_size()?
    );
    let vm = kvm.create_vm()?;
    let mut ram = GuestRam::new(MEM_SIZE)?;
    ram.write(CODE_ADDR as usize, &guest_code(loops));
    let region = kvm_userspace_memory_region {
        slot: 0,
        guest_phys_addr: 0,
        memory_size: MEM_SIZE as u64,
        userspace_addr: ram.ptr as u64,
        flags: 0,
    };
    // SAFETY: the region points at `ram`, a live mapping of MEM_SIZE bytes
    // that outlives the VM (it is dropped after `vm` at the end of this fn).
    unsafe { vm.set_user_memory_region(region)? };

    let mut vcpu = vm.create_vcpu(0)?;
    let mut sregs = vcpu.get_sregs()?;
    sregs.cs.base = 0;
    sregs.cs.selector = 0;
    vcpu.set_sregs(&sregs)?;
    let mut regs = vcpu.get_regs()?;
    regs.rip = CODE_ADDR;
    regs.rflags = 2;
    vcpu.set_regs(&regs)?;

    let mut serial = Vec::new();
    let mut mmio = Vec::new();
    let mut loop_exits = 0u32;
    let mut exits = 0u32;
    let start = Instant::now();
    let mut loop_start = None;
    loop {
        let exit = vcpu.run()?;
        exits += 1;
        match exit {
            VcpuExit::IoOut(0x3f8, data) => serial.extend_from_slice(data),
            VcpuExit::IoOut(0x80, _) => {
                loop_start.get_or_insert_with(Instant::now);
                loop_exits += 1;
            }
            VcpuExit::MmioWrite(addr, data) => mmio.push((addr, data.to_vec())),
            VcpuExit::Hlt => break,
            other => anyhow::bail!("unexpected exit {other:?}"),
        }
        anyhow::ensure!(exits <= u32::from(loops) + 10, "too many exits");
    }
    let total = start.elapsed();
    let loop_time = loop_start.map(|t| t.elapsed()).unwrap_or_default();
    let serial = String::from_utf8_lossy(&serial).into_owned();
    println!("KVM_PROBE: serial={serial:?}");
    println!("KVM_PROBE: mmio={mmio:x?}");
    anyhow::ensure!(serial == "K\n", "serial output {serial:?}");
    anyhow::ensure!(mmio == [(0x10000, vec![0x42])], "mmio writes {mmio:x?}");
    anyhow::ensure!(
        loop_exits == u32::from(loops),
        "{loop_exits} loop exits, want {loops}"
    );
    let per_exit_us = loop_time.as_secs_f64() * 1e6 / f64::from(loop_exits.max(1));
    println!(
        "KVM_PROBE: OK exits={exits} exit_us={per_exit_us:.1} total_ms={:.1}",
        total.as_secs_f64() * 1e3
    );
    Ok(())
}
