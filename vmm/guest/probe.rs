// SPDX-License-Identifier: Apache-2.0
//! The sheaf probe guest: a freestanding x86_64 kernel of a few thousand
//! instructions that exercises a VMM the way Linux does.
//!
//! It boots through either
//! - the Linux 64-bit boot protocol (`_start`, long mode, `boot_params` in RSI), or
//! - PVH (`pvh_start`, 32-bit protected mode, `hvm_start_info` in EBX; it
//!   builds its own page tables and enters long mode),
//!
//! then checks the boot information (magic numbers, the e820 map and its
//! legacy BIOS hole, the command line, the ACPI RSDP), prints over COM1,
//! finds virtio-mmio block devices from `virtio_mmio.device=` on the command
//! line, negotiates features, sets up a split virtqueue, and issues GET_ID,
//! IN, OUT, FLUSH and IN again, waiting for each completion on an interrupt
//! routed through the IOAPIC. It ends by writing a status to the debug-exit
//! port 0xf4: 0 when every check passed, otherwise the failed check's code.
//!
//! With `probe.ip=A.B.C.D` it then drives the first virtio-net card and
//! answers ARP, ICMP echo and UDP echo (port 7) until told to quit (see
//! `net.rs`).
//!
//! Command-line switches: `probe.token=T` (echoed), `probe.need_disk=1`,
//! `probe.spin=1` / `probe.halt=1` (stay alive instead of exiting),
//! `probe.log=N` (+ `probe.log_base=SECTOR`, `probe.log_pause=ITER`): verify
//! the records of a small on-disk log, then append N more, printing
//! `log: ack k` once record k is written and flushed (used by the
//! orchestrator's failover tests). With `probe.dirty=P` (+
//! `probe.dirty_every=ITER`) the pause between records also writes one
//! page of a P-page area (at most 1024) every ITER loop iterations, round
//! robin: a guest that dirties memory at a steady rate (migration tests).
//! `probe.readloop=B` (+ `probe.read_base=SECTOR`): read known disk blocks
//! into B buffers round robin forever, checking each buffer still holds
//! what was last read into it before reading again (device writes into
//! RAM the vCPU never writes; migration tests), printing `read: ok R`
//! after round R and `read: BAD i` on a mismatch.
//!
//! Built by `vmm/build.rs` with the host's x86_64-unknown-linux-gnu target,
//! `-nostdlib -static` and `probe.ld`; no prebuilt blob.
#![no_std]
#![no_main]
#![allow(clippy::all)]

use core::arch::{asm, global_asm};
use core::ptr::{read_volatile, write_volatile};
use core::sync::atomic::{AtomicU64, Ordering, fence};

mod net;

global_asm!(
    r#"
    .section .text.boot, "ax"
    .code64
    .global _start
_start:
    cli
    mov rsp, OFFSET probe_stack_top
    xor edi, edi
    call probe_main
2:  hlt
    jmp 2b

    .code32
    .global pvh_start
pvh_start:
    cli
    mov esp, OFFSET probe_stack_top
    mov eax, OFFSET probe_pdpt
    or eax, 3
    mov dword ptr [probe_pml4], eax
    xor ecx, ecx
3:  mov eax, ecx
    shl eax, 12
    add eax, OFFSET probe_pd
    or eax, 3
    mov dword ptr [probe_pdpt + ecx*8], eax
    inc ecx
    cmp ecx, 4
    jb 3b
    xor ecx, ecx
4:  mov eax, ecx
    shl eax, 21
    or eax, 0x83
    mov dword ptr [probe_pd + ecx*8], eax
    mov eax, ecx
    shr eax, 11
    mov dword ptr [probe_pd + ecx*8 + 4], eax
    inc ecx
    cmp ecx, 2048
    jb 4b
    mov eax, cr4
    or eax, 0x620
    mov cr4, eax
    mov eax, OFFSET probe_pml4
    mov cr3, eax
    mov ecx, 0xC0000080
    rdmsr
    or eax, 0x100
    wrmsr
    mov eax, cr0
    and eax, 0x9FFFFFFB
    or eax, 0x80000003
    mov cr0, eax
    lgdt [probe_gdt_ptr]
    // jmp far 0x08:pvh64 (opcode EA, ptr16:32)
    .byte 0xea
    .long pvh64
    .word 0x08

    .code64
pvh64:
    mov ax, 0x10
    mov ds, ax
    mov es, ax
    mov ss, ax
    mov fs, ax
    mov gs, ax
    mov rsp, OFFSET probe_stack_top
    mov edi, 1
    mov esi, ebx
    call probe_main
5:  hlt
    jmp 5b

    .global probe_irq_handler
probe_irq_handler:
    push rax
    lock inc qword ptr [PROBE_IRQS]
    mov rax, 0xfee000b0
    mov dword ptr [rax], 0
    pop rax
    iretq

    .global probe_exc_handler
probe_exc_handler:
    mov dx, 0xf4
    mov eax, 0xEE
    out dx, eax
6:  hlt
    jmp 6b

    .section .rodata
    .align 16
probe_gdt:
    .quad 0
    .quad 0x00af9a000000ffff
    .quad 0x00cf92000000ffff
probe_gdt_ptr:
    .word 23
    .long probe_gdt

    .section .note.Xen, "a", @note
    .align 4
    .long 4
    .long 4
    .long 18
    .asciz "Xen"
    .align 4
    .long pvh_start
    .align 4

    .section .bss
    .align 4096
    .global probe_pml4
probe_pml4: .skip 4096
probe_pdpt: .skip 4096
probe_pd: .skip 16384
    .align 16
probe_stack: .skip 16384
probe_stack_top:
"#
);

unsafe extern "C" {
    fn probe_irq_handler();
    fn probe_exc_handler();
}

#[unsafe(no_mangle)]
static PROBE_IRQS: AtomicU64 = AtomicU64::new(0);

// ---- freestanding runtime --------------------------------------------------

#[unsafe(no_mangle)]
unsafe extern "C" fn memcpy(dst: *mut u8, src: *const u8, n: usize) -> *mut u8 {
    unsafe { asm!("rep movsb", inout("rcx") n => _, inout("rdi") dst => _, inout("rsi") src => _) };
    dst
}

#[unsafe(no_mangle)]
unsafe extern "C" fn memmove(dst: *mut u8, src: *const u8, n: usize) -> *mut u8 {
    if (dst as usize) <= (src as usize) || (dst as usize) >= (src as usize + n) {
        return unsafe { memcpy(dst, src, n) };
    }
    unsafe {
        asm!("std", "rep movsb", "cld",
             inout("rcx") n => _, inout("rdi") dst.add(n - 1) => _, inout("rsi") src.add(n - 1) => _)
    };
    dst
}

#[unsafe(no_mangle)]
unsafe extern "C" fn memset(dst: *mut u8, c: i32, n: usize) -> *mut u8 {
    unsafe { asm!("rep stosb", inout("rcx") n => _, inout("rdi") dst => _, in("al") c as u8) };
    dst
}

#[unsafe(no_mangle)]
unsafe extern "C" fn memcmp(a: *const u8, b: *const u8, n: usize) -> i32 {
    let mut i = 0;
    while i < n {
        let (x, y) = unsafe { (read_volatile(a.add(i)), read_volatile(b.add(i))) };
        if x != y {
            return x as i32 - y as i32;
        }
        i += 1;
    }
    0
}

#[unsafe(no_mangle)]
unsafe extern "C" fn bcmp(a: *const u8, b: *const u8, n: usize) -> i32 {
    unsafe { memcmp(a, b, n) }
}

/// libcore is prebuilt with unwinding tables that name this symbol; with
/// `panic=abort` it is never called.
#[unsafe(no_mangle)]
extern "C" fn rust_eh_personality() {}

#[panic_handler]
fn panic(_: &core::panic::PanicInfo<'_>) -> ! {
    exit(0xEF)
}

// ---- hardware access -------------------------------------------------------

fn outb(port: u16, v: u8) {
    unsafe { asm!("out dx, al", in("dx") port, in("al") v, options(nostack)) };
}

fn outl(port: u16, v: u32) {
    unsafe { asm!("out dx, eax", in("dx") port, in("eax") v, options(nostack)) };
}

fn rd32(addr: u64) -> u32 {
    unsafe { read_volatile(addr as *const u32) }
}

fn wr32(addr: u64, v: u32) {
    unsafe { write_volatile(addr as *mut u32, v) }
}

fn rd(addr: u64, off: u64, len: usize) -> u64 {
    let mut v = 0u64;
    let mut i = 0;
    while i < len {
        v |= (unsafe { read_volatile((addr + off + i as u64) as *const u8) } as u64) << (8 * i);
        i += 1;
    }
    v
}

fn exit(code: u32) -> ! {
    outl(0xf4, code);
    loop {
        unsafe { asm!("cli", "hlt") };
    }
}

// ---- console ---------------------------------------------------------------

fn putc(c: u8) {
    outb(0x3f8, c);
}

fn puts(s: &str) {
    for b in s.bytes() {
        putc(b);
    }
}

fn put_bytes(s: &[u8]) {
    for &b in s {
        putc(if (0x20..0x7f).contains(&b) { b } else { b'.' });
    }
}

fn put_hex(v: u64) {
    puts("0x");
    let mut started = false;
    let mut shift = 60i32;
    while shift >= 0 {
        let d = ((v >> shift) & 0xf) as u8;
        if d != 0 || started || shift == 0 {
            started = true;
            putc(if d < 10 { b'0' + d } else { b'a' + d - 10 });
        }
        shift -= 4;
    }
}

fn put_dec(mut v: u64) {
    let mut buf = [0u8; 20];
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    put_bytes(&buf[i..]);
}

fn fail(code: u32, what: &str) -> ! {
    puts("probe: FAIL ");
    puts(what);
    puts("\n");
    exit(code)
}

// ---- boot information ------------------------------------------------------

const E820_MAX: usize = 32;

struct BootInfo {
    cmdline: &'static [u8],
    e820: [(u64, u64, u32); E820_MAX],
    e820_len: usize,
    rsdp: u64,
    /// Initramfs address and size (0, 0 when none).
    initrd: (u64, u64),
}

fn cstr(addr: u64) -> &'static [u8] {
    if addr == 0 {
        return &[];
    }
    let mut n = 0usize;
    while n < 4096 && unsafe { read_volatile((addr + n as u64) as *const u8) } != 0 {
        n += 1;
    }
    unsafe { core::slice::from_raw_parts(addr as *const u8, n) }
}

fn boot_info(pvh: bool, info: u64) -> BootInfo {
    let mut bi = BootInfo {
        cmdline: &[],
        e820: [(0, 0, 0); E820_MAX],
        e820_len: 0,
        rsdp: 0,
        initrd: (0, 0),
    };
    if pvh {
        if rd(info, 0, 4) != 0x336e_c578 {
            fail(0x10, "hvm_start_info magic");
        }
        bi.cmdline = cstr(rd(info, 24, 8));
        bi.rsdp = rd(info, 32, 8);
        if rd(info, 12, 4) >= 1 {
            let m = rd(info, 16, 8);
            bi.initrd = (rd(m, 0, 8), rd(m, 8, 8));
        }
        let map = rd(info, 40, 8);
        let n = (rd(info, 48, 4) as usize).min(E820_MAX);
        for i in 0..n {
            let e = map + i as u64 * 24;
            bi.e820[i] = (rd(e, 0, 8), rd(e, 8, 8), rd(e, 16, 4) as u32);
        }
        bi.e820_len = n;
    } else {
        if rd(info, 0x1fe, 2) != 0xaa55 || rd(info, 0x202, 4) != 0x5372_6448 {
            fail(0x10, "boot_params magic");
        }
        bi.cmdline = cstr(rd(info, 0x228, 4));
        bi.rsdp = rd(info, 0x70, 8);
        bi.initrd = (rd(info, 0x218, 4), rd(info, 0x21c, 4));
        let n = (rd(info, 0x1e8, 1) as usize).min(E820_MAX);
        for i in 0..n {
            let e = info + 0x2d0 + i as u64 * 20;
            bi.e820[i] = (rd(e, 0, 8), rd(e, 8, 8), rd(e, 16, 4) as u32);
        }
        bi.e820_len = n;
    }
    bi
}

fn check_e820(bi: &BootInfo) -> u64 {
    let map = &bi.e820[..bi.e820_len];
    if map.is_empty() {
        fail(0x11, "empty e820 map");
    }
    let mut ram = 0u64;
    let mut covers_image = false;
    for &(addr, size, ty) in map {
        if ty == 1 {
            ram += size;
            // No usable RAM in the legacy VGA/BIOS hole.
            if addr < 0x10_0000 && addr + size > 0xa_0000 {
                fail(0x12, "e820 RAM overlaps the BIOS hole");
            }
            if addr <= 0x20_0000 && addr + size > 0x20_0000 {
                covers_image = true;
            }
        }
    }
    if map[0].0 != 0 || map[0].2 != 1 || !covers_image {
        fail(0x13, "e820 lacks low RAM or RAM under the image");
    }
    ram
}

fn find<'a>(hay: &'a [u8], needle: &[u8]) -> Option<&'a [u8]> {
    let mut i = 0;
    while i + needle.len() <= hay.len() {
        if &hay[i..i + needle.len()] == needle && (i == 0 || hay[i - 1] == b' ') {
            let rest = &hay[i + needle.len()..];
            let end = rest.iter().position(|&c| c == b' ').unwrap_or(rest.len());
            return Some(&rest[..end]);
        }
        i += 1;
    }
    None
}

fn parse_num(s: &[u8]) -> Option<(u64, &[u8])> {
    let (radix, mut s) = if s.starts_with(b"0x") { (16, &s[2..]) } else { (10, s) };
    let mut v = 0u64;
    let mut any = false;
    while let Some(&c) = s.first() {
        let d = match c {
            b'0'..=b'9' => c - b'0',
            b'a'..=b'f' if radix == 16 => c - b'a' + 10,
            b'A'..=b'F' if radix == 16 => c - b'A' + 10,
            _ => break,
        };
        v = v.checked_mul(radix)?.checked_add(d as u64)?;
        any = true;
        s = &s[1..];
    }
    if !any {
        return None;
    }
    match s.first() {
        Some(b'K') | Some(b'k') => Some((v << 10, &s[1..])),
        Some(b'M') | Some(b'm') => Some((v << 20, &s[1..])),
        _ => Some((v, s)),
    }
}

/// `virtio_mmio.device=<size>@<base>:<irq>` entries, in order.
fn virtio_devices(cmdline: &[u8], out: &mut [(u64, u32); 8]) -> usize {
    let mut n = 0;
    let mut rest = cmdline;
    let key = b"virtio_mmio.device=";
    while n < out.len() {
        let Some(v) = find(rest, key) else { break };
        let off = (v.as_ptr() as usize - rest.as_ptr() as usize) + v.len();
        rest = &rest[off..];
        let Some((_size, s)) = parse_num(v) else { continue };
        let Some(s) = s.strip_prefix(b"@") else { continue };
        let Some((base, s)) = parse_num(s) else { continue };
        let Some(s) = s.strip_prefix(b":") else { continue };
        let Some((irq, _)) = parse_num(s) else { continue };
        out[n] = (base, irq as u32);
        n += 1;
    }
    n
}

// ---- interrupts ------------------------------------------------------------

#[repr(C, align(16))]
struct Idt([u64; 512]);
static mut IDT: Idt = Idt([0; 512]);

const VIRTIO_VECTOR: usize = 0x30;

fn set_gate(vector: usize, handler: unsafe extern "C" fn(), cs: u16) {
    let h = handler as usize as u64;
    let lo = (h & 0xffff) | ((cs as u64) << 16) | (0x8e00u64 << 32) | ((h >> 16) & 0xffff) << 48;
    let hi = h >> 32;
    unsafe {
        let idt = &raw mut IDT;
        (*idt).0[vector * 2] = lo;
        (*idt).0[vector * 2 + 1] = hi;
    }
}

fn setup_interrupts(irq: u32) {
    let cs: u16;
    unsafe { asm!("mov {0:x}, cs", out(reg) cs) };
    for v in 0..32 {
        set_gate(v, probe_exc_handler, cs);
    }
    set_gate(VIRTIO_VECTOR, probe_irq_handler, cs);
    let ptr: [u16; 5] = {
        let base = (&raw const IDT) as u64;
        [4095, base as u16, (base >> 16) as u16, (base >> 32) as u16, (base >> 48) as u16]
    };
    unsafe { asm!("lidt [{0}]", in(reg) ptr.as_ptr()) };
    // Mask the 8259s; deliver through the IOAPIC only.
    outb(0x21, 0xff);
    outb(0xa1, 0xff);
    // Enable the local APIC (spurious vector 0xff).
    wr32(0xfee0_00f0, 0x1ff);
    // Route the pin: edge, active high, fixed, physical destination APIC 0.
    let (ioapic, pin) = if irq >= 24 { (0xfec1_0000u64, irq - 24) } else { (0xfec0_0000u64, irq) };
    wr32(ioapic, 0x10 + 2 * pin + 1);
    wr32(ioapic + 0x10, 0);
    wr32(ioapic, 0x10 + 2 * pin);
    wr32(ioapic + 0x10, VIRTIO_VECTOR as u32);
}

// ---- virtio-blk over virtio-mmio --------------------------------------------

const QSIZE: u16 = 8;

#[repr(C, align(4096))]
struct Ring([u8; 8192]);
static mut RING: Ring = Ring([0; 8192]);

#[repr(C, align(4096))]
struct Buffers {
    hdr: [u8; 16],
    status: [u8; 16],
    id: [u8; 32],
    data: [u8; 512],
    check: [u8; 512],
}
static mut BUF: Buffers = Buffers {
    hdr: [0; 16],
    status: [0; 16],
    id: [0; 32],
    data: [0; 512],
    check: [0; 512],
};

struct Blk {
    base: u64,
    avail_idx: u16,
    used_seen: u16,
}

fn ring_base() -> u64 {
    (&raw const RING) as u64
}

impl Blk {
    fn desc_addr(&self) -> u64 {
        ring_base()
    }
    fn avail_addr(&self) -> u64 {
        ring_base() + 16 * QSIZE as u64
    }
    fn used_addr(&self) -> u64 {
        ring_base() + 4096
    }

    fn init(base: u64) -> Result<(Blk, u64), (u32, &'static str)> {
        if rd32(base) != 0x7472_6976 || rd32(base + 4) != 2 {
            return Err((0x20, "virtio-mmio magic/version"));
        }
        if rd32(base + 8) != 2 {
            return Err((0x20, "not a block device"));
        }
        wr32(base + 0x70, 0);
        wr32(base + 0x70, 1);
        wr32(base + 0x70, 1 | 2);
        wr32(base + 0x14, 1);
        let hi = rd32(base + 0x10);
        wr32(base + 0x14, 0);
        let lo = rd32(base + 0x10);
        if hi & 1 == 0 {
            return Err((0x21, "device lacks VIRTIO_F_VERSION_1"));
        }
        wr32(base + 0x24, 1);
        wr32(base + 0x20, 1);
        wr32(base + 0x24, 0);
        wr32(base + 0x20, lo & (1 << 9)); // FLUSH if offered
        wr32(base + 0x70, 1 | 2 | 8);
        if rd32(base + 0x70) & 8 == 0 {
            return Err((0x21, "FEATURES_OK not accepted"));
        }
        let capacity = rd32(base + 0x100) as u64 | (rd32(base + 0x104) as u64) << 32;
        wr32(base + 0x30, 0);
        if rd32(base + 0x44) != 0 || rd32(base + 0x34) < QSIZE as u32 {
            return Err((0x22, "queue 0 unavailable"));
        }
        let blk = Blk { base, avail_idx: 0, used_seen: 0 };
        wr32(base + 0x38, QSIZE as u32);
        for (off, addr) in [(0x80, blk.desc_addr()), (0x90, blk.avail_addr()), (0xa0, blk.used_addr())] {
            wr32(base + off, addr as u32);
            wr32(base + off + 4, (addr >> 32) as u32);
        }
        wr32(base + 0x44, 1);
        wr32(base + 0x70, 1 | 2 | 8 | 4);
        Ok((blk, capacity))
    }

    fn set_desc(&self, i: u16, addr: u64, len: u32, write: bool, next: Option<u16>) {
        let d = self.desc_addr() + i as u64 * 16;
        let flags = (if write { 2 } else { 0 }) | (if next.is_some() { 1 } else { 0 });
        unsafe {
            write_volatile(d as *mut u64, addr);
            write_volatile((d + 8) as *mut u32, len);
            write_volatile((d + 12) as *mut u16, flags);
            write_volatile((d + 14) as *mut u16, next.unwrap_or(0));
        }
    }

    /// Submits one request (header, optional data, status) and waits for it.
    fn request(&mut self, ty: u32, sector: u64, data: Option<(u64, u32, bool)>) -> u8 {
        unsafe {
            let h = &mut *(&raw mut BUF.hdr);
            h[0..4].copy_from_slice(&ty.to_le_bytes());
            h[4..8].copy_from_slice(&0u32.to_le_bytes());
            h[8..16].copy_from_slice(&sector.to_le_bytes());
            write_volatile(&raw mut BUF.status[0], 0xff);
        }
        let hdr = unsafe { (&raw const BUF.hdr) as u64 };
        let status = unsafe { (&raw const BUF.status) as u64 };
        match data {
            Some((addr, len, write)) => {
                self.set_desc(0, hdr, 16, false, Some(1));
                self.set_desc(1, addr, len, write, Some(2));
                self.set_desc(2, status, 1, true, None);
            }
            None => {
                self.set_desc(0, hdr, 16, false, Some(2));
                self.set_desc(2, status, 1, true, None);
            }
        }
        let avail = self.avail_addr();
        unsafe {
            write_volatile((avail + 4 + 2 * (self.avail_idx % QSIZE) as u64) as *mut u16, 0);
            fence(Ordering::SeqCst);
            self.avail_idx = self.avail_idx.wrapping_add(1);
            write_volatile((avail + 2) as *mut u16, self.avail_idx);
        }
        fence(Ordering::SeqCst);
        let irqs = PROBE_IRQS.load(Ordering::SeqCst);
        wr32(self.base + 0x50, 0);
        let used = self.used_addr();
        // Wait for both the used-ring update and its interrupt. Interrupts
        // stay disabled except inside `sti; hlt`, which is atomic with
        // respect to interrupt delivery, so no wake-up is lost.
        let mut spins = 0u32;
        loop {
            let idx = unsafe { read_volatile((used + 2) as *const u16) };
            if idx != self.used_seen && PROBE_IRQS.load(Ordering::SeqCst) != irqs {
                break;
            }
            spins += 1;
            if spins > 1000 {
                fail(0x25, "no completion interrupt");
            }
            unsafe { asm!("sti", "hlt", "cli") };
        }
        let isr = rd32(self.base + 0x60);
        wr32(self.base + 0x64, isr);
        self.used_seen = self.used_seen.wrapping_add(1);
        fence(Ordering::SeqCst);
        unsafe { read_volatile(&raw const BUF.status[0]) }
    }
}

fn disk_test(base: u64, irq: u32) -> (Blk, u64) {
    puts("virtio: blk at ");
    put_hex(base);
    puts(" irq ");
    put_dec(irq as u64);
    puts("\n");
    setup_interrupts(irq);
    let (mut blk, capacity) = match Blk::init(base) {
        Ok(v) => v,
        Err((code, what)) => fail(code, what),
    };
    puts("virtio: capacity ");
    put_dec(capacity);
    puts(" sectors\n");
    if capacity < 2 {
        fail(0x22, "disk smaller than 2 sectors");
    }
    let id = unsafe { (&raw const BUF.id) as u64 };
    let data = unsafe { (&raw const BUF.data) as u64 };
    let check = unsafe { (&raw const BUF.check) as u64 };
    if blk.request(8, 0, Some((id, 20, true))) != 0 {
        fail(0x23, "GET_ID");
    }
    puts("virtio: id ");
    let idb = unsafe { &*(&raw const BUF.id) };
    put_bytes(&idb[..idb.iter().position(|&c| c == 0).unwrap_or(20)]);
    puts("\n");
    if blk.request(0, 0, Some((data, 512, true))) != 0 {
        fail(0x23, "IN sector 0");
    }
    let d = unsafe { &mut *(&raw mut BUF.data) };
    puts("virtio: sector0 ");
    put_bytes(&d[..d.iter().position(|&c| c == 0).unwrap_or(64).min(64)]);
    puts("\n");
    // Reply: "PROBE-REPLY:" + the first 32 bytes read, written to sector 1.
    let mut reply = [0u8; 512];
    reply[..12].copy_from_slice(b"PROBE-REPLY:");
    reply[12..44].copy_from_slice(&d[..32]);
    d.copy_from_slice(&reply);
    if blk.request(1, 1, Some((data, 512, false))) != 0 {
        fail(0x23, "OUT sector 1");
    }
    if blk.request(4, 0, None) != 0 {
        fail(0x23, "FLUSH");
    }
    if blk.request(0, 1, Some((check, 512, true))) != 0 {
        fail(0x23, "IN sector 1");
    }
    let c = unsafe { &*(&raw const BUF.check) };
    if c[..] != reply[..] {
        fail(0x24, "read-back mismatch");
    }
    // A request beyond the end of the disk must fail with IOERR (1).
    if blk.request(0, capacity, Some((check, 512, true))) != 1 {
        fail(0x26, "out-of-range read not rejected");
    }
    puts("virtio: get_id, read, write, flush, read-back ok\n");
    (blk, capacity)
}

// ---- log mode (probe.log=N) -------------------------------------------------
//
// A tiny write-ahead log for failover tests: record k lives in the first
// sector of 4 KiB block (base/8 + k), so each record is its own volume block.
// At boot every existing record is verified (magic, index, checksum); then N
// new records are appended, each written and flushed before `log: ack k` is
// printed. A record acknowledged on the console is therefore durable.

const LOG_MAGIC: &[u8; 8] = b"SHEAFLOG";

fn fnv1a(data: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for &b in data {
        h ^= b as u64;
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    h
}

fn log_record(k: u64, token: &[u8], out: &mut [u8; 512]) {
    out.fill(0);
    out[..8].copy_from_slice(LOG_MAGIC);
    out[8..16].copy_from_slice(&k.to_le_bytes());
    let n = token.len().min(32);
    out[16..16 + n].copy_from_slice(&token[..n]);
    let mut i = 48;
    while i < 504 {
        out[i] = (k.wrapping_mul(31).wrapping_add(i as u64) & 0xff) as u8;
        i += 1;
    }
    let sum = fnv1a(&out[..504]);
    out[504..].copy_from_slice(&sum.to_le_bytes());
}

/// Pages `probe.dirty=P` may keep writing.
const DIRTY_PAGES: usize = 1024;

#[repr(C, align(4096))]
struct DirtyArea([u8; DIRTY_PAGES * 4096]);

static mut DIRTY: DirtyArea = DirtyArea([0; DIRTY_PAGES * 4096]);

fn log_mode(blk: &mut Blk, capacity: u64, cmdline: &[u8]) {
    let count = find(cmdline, b"probe.log=").and_then(parse_num).map(|(v, _)| v).unwrap_or(0);
    let base = find(cmdline, b"probe.log_base=").and_then(parse_num).map(|(v, _)| v).unwrap_or(2048);
    let pause = find(cmdline, b"probe.log_pause=").and_then(parse_num).map(|(v, _)| v).unwrap_or(0);
    let token = find(cmdline, b"probe.token=").unwrap_or(&[]);
    let dirty = find(cmdline, b"probe.dirty=").and_then(parse_num).map(|(v, _)| v).unwrap_or(0).min(DIRTY_PAGES as u64);
    let every = find(cmdline, b"probe.dirty_every=").and_then(parse_num).map(|(v, _)| v).unwrap_or(1000).max(1);
    let mut written = 0u64;
    let slots = if capacity > base { (capacity - base) / 8 } else { 0 };
    let data = unsafe { (&raw const BUF.data) as u64 };
    // Scan and verify the records already there.
    let mut k = 0u64;
    while k < slots {
        if blk.request(0, base + 8 * k, Some((data, 512, true))) != 0 {
            fail(0x30, "log: read failed");
        }
        let d = unsafe { &*(&raw const BUF.data) };
        if &d[..8] != LOG_MAGIC {
            break;
        }
        let idx = u64::from_le_bytes([d[8], d[9], d[10], d[11], d[12], d[13], d[14], d[15]]);
        let sum = u64::from_le_bytes([d[504], d[505], d[506], d[507], d[508], d[509], d[510], d[511]]);
        if idx != k || sum != fnv1a(&d[..504]) {
            puts("log: CORRUPT ");
            put_dec(k);
            puts("\n");
            fail(0x31, "log: corrupt record");
        }
        k += 1;
    }
    puts("log: found ");
    put_dec(k);
    puts(" records\n");
    let end = (k + count).min(slots);
    while k < end {
        let mut rec = [0u8; 512];
        log_record(k, token, &mut rec);
        unsafe { (*(&raw mut BUF.data)).copy_from_slice(&rec) };
        if blk.request(1, base + 8 * k, Some((data, 512, false))) != 0 {
            fail(0x32, "log: write failed");
        }
        if blk.request(4, 0, None) != 0 {
            fail(0x32, "log: flush failed");
        }
        puts("log: ack ");
        put_dec(k);
        puts("\n");
        k += 1;
        let mut i = 0u64;
        while i < pause {
            if dirty != 0 && i % every == 0 {
                let page = (written % dirty) as usize;
                // SAFETY: the offset is inside DIRTY (page < DIRTY_PAGES).
                unsafe {
                    let p = (&raw mut DIRTY.0).cast::<u8>().add(page * 4096 + (written / dirty % 4096) as usize);
                    write_volatile(p, written as u8);
                }
                written += 1;
            }
            unsafe { asm!("nop") };
            i += 1;
        }
    }
    puts("log: done ");
    put_dec(k);
    puts("\n");
}

// ---- read-loop mode (probe.readloop=B) --------------------------------------
//
// Memory written only by a device: block j (4 KiB at sector base + 8j, for
// j <= B) holds the words READ_MAGIC ^ (j << 16 | w). Read i puts block
// i % (B + 1) into buffer i % B of the DIRTY area, which the vCPU only
// reads; before that it checks the buffer still holds block
// (i - B) % (B + 1), the one read i - B put there. A migration that loses
// a device write shows as `read: BAD i` on the target.

const READ_MAGIC: u64 = 0x5348_4541_4652_4400;

fn block_ok(buf: u64, j: u64) -> bool {
    let mut w = 0u64;
    while w < 512 {
        // SAFETY: `buf` is a 4 KiB buffer inside DIRTY.
        if unsafe { read_volatile((buf + 8 * w) as *const u64) } != READ_MAGIC ^ (j << 16 | w) {
            return false;
        }
        w += 1;
    }
    true
}

fn read_mode(blk: &mut Blk, capacity: u64, cmdline: &[u8]) -> ! {
    let want = find(cmdline, b"probe.readloop=").and_then(parse_num).map(|(v, _)| v).unwrap_or(0);
    let base = find(cmdline, b"probe.read_base=").and_then(parse_num).map(|(v, _)| v).unwrap_or(4096);
    let room = if capacity > base { (capacity - base) / 8 } else { 0 };
    let bufs = want.min(DIRTY_PAGES as u64).min(room.saturating_sub(1));
    if bufs == 0 {
        fail(0x50, "read: no buffers or no room on the disk");
    }
    let blocks = bufs + 1;
    let area = unsafe { (&raw const DIRTY.0) as u64 };
    puts("read: looping over ");
    put_dec(bufs);
    puts(" buffers\n");
    let mut i = 0u64;
    loop {
        let buf = area + (i % bufs) * 4096;
        if i >= bufs && !block_ok(buf, (i - bufs) % blocks) {
            puts("read: BAD ");
            put_dec(i);
            puts("\n");
            fail(0x52, "read: a buffer lost what the device wrote");
        }
        if blk.request(0, base + 8 * (i % blocks), Some((buf, 4096, true))) != 0 {
            fail(0x51, "read: IN failed");
        }
        if !block_ok(buf, i % blocks) {
            puts("read: BAD ");
            put_dec(i);
            puts("\n");
            fail(0x52, "read: wrong data");
        }
        i += 1;
        if i % bufs == 0 {
            puts("read: ok ");
            put_dec(i / bufs);
            puts("\n");
        }
    }
}

#[unsafe(no_mangle)]
extern "C" fn probe_main(pvh: u64, info: u64) -> ! {
    puts("\nsheaf-probe: boot=");
    puts(if pvh == 1 { "pvh" } else { "linux64" });
    puts("\n");
    let bi = boot_info(pvh == 1, info);
    let ram = check_e820(&bi);
    puts("e820: ");
    put_dec(bi.e820_len as u64);
    puts(" entries, ");
    put_dec(ram >> 10);
    puts(" KiB RAM\n");
    puts("cmdline: ");
    put_bytes(bi.cmdline);
    puts("\n");
    if bi.initrd.1 != 0 {
        // Its size and first bytes, so a test can tell which file was loaded.
        puts("initrd: ");
        put_dec(bi.initrd.1);
        puts(" bytes, head ");
        let n = bi.initrd.1.min(16) as usize;
        // SAFETY: the VMM placed the initramfs in identity-mapped guest RAM.
        put_bytes(unsafe { core::slice::from_raw_parts(bi.initrd.0 as *const u8, n) });
        puts("\n");
    }
    if let Some(tok) = find(bi.cmdline, b"probe.token=") {
        puts("token: ");
        put_bytes(tok);
        puts("\n");
    }
    if bi.rsdp != 0 {
        let sig = unsafe { core::slice::from_raw_parts(bi.rsdp as *const u8, 8) };
        if sig != b"RSD PTR " {
            fail(0x14, "RSDP signature");
        }
        puts("acpi: rsdp ok\n");
    }
    let mut devs = [(0u64, 0u32); 8];
    let n = virtio_devices(bi.cmdline, &mut devs);
    let mut tested = false;
    for &(base, irq) in &devs[..n] {
        if rd32(base) == 0x7472_6976 && rd32(base + 8) == 2 {
            let (mut blk, capacity) = disk_test(base, irq);
            if find(bi.cmdline, b"probe.log=").is_some() {
                log_mode(&mut blk, capacity, bi.cmdline);
            }
            if find(bi.cmdline, b"probe.readloop=").is_some() {
                read_mode(&mut blk, capacity, bi.cmdline);
            }
            tested = true;
            break;
        }
    }
    if !tested && find(bi.cmdline, b"probe.need_disk=1").is_some() {
        fail(0x20, "no virtio-blk device found");
    }
    if find(bi.cmdline, b"probe.ip=").is_some() {
        match devs[..n].iter().find(|&&(base, _)| rd32(base) == 0x7472_6976 && rd32(base + 8) == 1) {
            Some(&(base, irq)) => net::net_test(base, irq, bi.cmdline),
            None => fail(0x40, "no virtio-net card found"),
        }
    }
    puts("probe: PASS\n");
    if find(bi.cmdline, b"probe.halt=1").is_some() {
        // Stay alive without using the CPU: a running, idle VM.
        loop {
            unsafe { asm!("cli", "hlt") };
        }
    }
    if find(bi.cmdline, b"probe.spin=1").is_some() {
        // Keep running (for pause/resume tests): a heartbeat byte now and then.
        loop {
            putc(b'.');
            let mut i = 0u32;
            while i < 2000 {
                unsafe { asm!("nop") };
                i += 1;
            }
        }
    }
    exit(0)
}
