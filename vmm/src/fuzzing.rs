// SPDX-License-Identifier: Apache-2.0
//! Fuzz cases over what a guest or a guest image controls, shared by the
//! cargo-fuzz targets in `fuzz/` (each a one-line call) and the property
//! tests below, which run every case on a few hundred inputs in the normal
//! test suite. Each case panics only when an invariant breaks.

use std::sync::{Arc, Mutex};

use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::EventFd;

use crate::acpi::{RESET_VALUE, S5_SLEEP_VALUE};
use crate::arch::x86_64::Entry;
use crate::arch::x86_64::layout;
use crate::boot::disk::{self, DiskBootFiles, MAX_INITRAMFS_BYTES, MAX_KERNEL_BYTES};
use crate::boot::{self, BootFiles};
use crate::config::{BootProtocol, KernelConfig};
use crate::devices::Bus;
use crate::devices::legacy::insert_pio_devices;
use crate::devices::serial::{ConsoleRing, SerialDevice, SerialOut, SerialSink};
use crate::devices::virtio::block::SyncAdapter;
use crate::exit::{ExitLatch, ExitReason};
use crate::{BlockBackend, MemBackend};

/// The disk image [`disk_boot_case`] mutates: an MBR with one ext4
/// partition holding `/boot/vmlinuz` (see `boot/testdata/README.md`).
pub const DISK_SEED: &[u8] = include_bytes!("boot/testdata/mbr-ext4.img");

/// Largest disk [`disk_boot_case`] builds from raw input.
const MAX_FUZZ_DISK: usize = 4 << 20;

/// Disk boot on a hostile image. First byte even: the rest are patches
/// `[offset lo, mid, hi, len, bytes...]` applied to [`DISK_SEED`] (so the
/// partition table and file system stay mostly intact and the search gets
/// deep); odd: the rest is the whole disk. [`disk::find`] must return
/// files within its caps holding an x86_64 kernel, or a named error.
pub fn disk_boot_case(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let image = if mode & 1 == 0 {
        let mut img = DISK_SEED.to_vec();
        let mut p = rest;
        while p.len() >= 4 {
            let off = usize::from(p[0]) | usize::from(p[1]) << 8 | usize::from(p[2]) << 16;
            let len = usize::from(p[3]).min(p.len() - 4);
            let bytes = &p[4..4 + len];
            p = &p[4 + len..];
            let off = off % img.len();
            let end = (off + bytes.len()).min(img.len());
            img[off..end].copy_from_slice(&bytes[..end - off]);
        }
        img
    } else {
        rest[..rest.len().min(MAX_FUZZ_DISK)].to_vec()
    };
    let backend: Arc<dyn BlockBackend> = Arc::new(MemBackend::from_bytes(image, "fuzz"));
    let partition = (mode & 2 != 0).then_some(u32::from(mode >> 2));
    match disk::find(Arc::new(SyncAdapter::new(backend)), 0, partition) {
        Ok(f) => {
            assert!(f.kernel.len() as u64 <= MAX_KERNEL_BYTES);
            assert!(disk::check_x86_kernel(&f.kernel, &f.kernel_path).is_ok());
            if let Some(i) = &f.initramfs {
                assert!(i.len() as u64 <= MAX_INITRAMFS_BYTES);
            }
            if let Some(n) = partition {
                assert!(f.kernel_path.starts_with(&format!("partition {n}:")));
                assert_eq!(f.root_partition, n);
            }
        }
        Err(e) => assert!(!e.to_string().is_empty()),
    }
}

/// Guest RAM [`kernel_load_case`] loads into.
const KERNEL_MEM: usize = 32 << 20;

/// A bzImage header (boot protocol 2.15, 64-bit entry, one setup sector)
/// followed by a page of "kernel".
pub fn bzimage_template() -> Vec<u8> {
    let mut k = vec![0u8; 0x1400];
    k[0x1f1] = 1;
    k[0x1fe] = 0x55;
    k[0x1ff] = 0xaa;
    k[0x202..0x206].copy_from_slice(b"HdrS");
    k[0x206..0x208].copy_from_slice(&0x020fu16.to_le_bytes());
    k[0x211] = 1; // loadflags: LOADED_HIGH
    k[0x214..0x218].copy_from_slice(&0x10_0000u32.to_le_bytes()); // code32_start
    k[0x22c..0x230].copy_from_slice(&0x37ff_ffffu32.to_le_bytes()); // initrd_addr_max
    k[0x236] = 1; // xloadflags: 64-bit entry
    k
}

/// An x86_64 ELF executable with one loadable segment at 16 MiB.
pub fn elf_template() -> Vec<u8> {
    let mut k = vec![0u8; 0x1000];
    k[..4].copy_from_slice(b"\x7fELF");
    k[4] = 2; // ELFCLASS64
    k[5] = 1; // little endian
    k[6] = 1;
    k[16..18].copy_from_slice(&2u16.to_le_bytes()); // ET_EXEC
    k[18..20].copy_from_slice(&62u16.to_le_bytes()); // EM_X86_64
    k[20..24].copy_from_slice(&1u32.to_le_bytes());
    k[24..32].copy_from_slice(&0x100_0000u64.to_le_bytes()); // entry
    k[32..40].copy_from_slice(&64u64.to_le_bytes()); // phoff
    k[52..54].copy_from_slice(&64u16.to_le_bytes()); // ehsize
    k[54..56].copy_from_slice(&56u16.to_le_bytes()); // phentsize
    k[56..58].copy_from_slice(&1u16.to_le_bytes()); // phnum
    let ph = &mut k[64..120];
    ph[0..4].copy_from_slice(&1u32.to_le_bytes()); // PT_LOAD
    ph[4..8].copy_from_slice(&5u32.to_le_bytes()); // R+X
    ph[8..16].copy_from_slice(&0x200u64.to_le_bytes()); // offset
    ph[16..24].copy_from_slice(&0x100_0000u64.to_le_bytes()); // vaddr
    ph[24..32].copy_from_slice(&0x100_0000u64.to_le_bytes()); // paddr
    ph[32..40].copy_from_slice(&0xe00u64.to_le_bytes()); // filesz
    ph[40..48].copy_from_slice(&0x1000u64.to_le_bytes()); // memsz
    k
}

/// Kernel loading from a hostile image (as found on a disk). First byte:
/// bit 0 the boot protocol, bit 1 an initramfs, bits 2-3 the image: raw
/// (the rest of the input) or the rest XORed over [`bzimage_template`]
/// from its setup header on, or over [`elf_template`]. [`boot::load`] must
/// load it within guest memory or return a named error.
pub fn kernel_load_case(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let kernel = match (mode >> 2) & 3 {
        0 => rest.to_vec(),
        1 | 3 => xor_over(bzimage_template(), 0x1f0, rest),
        _ => xor_over(elf_template(), 0, rest),
    };
    let Ok(mem) = crate::memory::GuestMemory::from_ranges(&[(GuestAddress(0), KERNEL_MEM)]) else {
        return;
    };
    let cfg = KernelConfig {
        boot_protocol: if mode & 1 == 0 {
            BootProtocol::Linux64
        } else {
            BootProtocol::Pvh
        },
        ..KernelConfig::default()
    };
    let files = DiskBootFiles {
        kernel,
        kernel_path: "partition 1:/boot/vmlinuz".into(),
        initramfs: (mode & 2 != 0).then(|| vec![0x5a; 0x3000]),
        initramfs_path: None,
        root_uuid: String::new(),
        root_partition: 1,
        bytes_read: 0,
    };
    match boot::load(&mem, &cfg, BootFiles::Disk(&files), "console=ttyS0", 0) {
        Ok(l) => {
            if let Some((addr, size)) = l.initramfs {
                assert!(addr >= layout::HIMEM_START, "initramfs below 1 MiB");
                assert!(addr + size <= KERNEL_MEM as u64, "initramfs past RAM");
                let mut head = [0u8; 4];
                assert!(mem.read_slice(&mut head, GuestAddress(addr)).is_ok());
                assert_eq!(head, [0x5a; 4]);
            }
            if let (Entry::Pvh { .. }, BootProtocol::Linux64) = (l.entry, cfg.boot_protocol) {
                panic!("a PVH entry for a Linux64 boot");
            }
        }
        Err(e) => assert!(!e.to_string().is_empty()),
    }
}

fn xor_over(mut base: Vec<u8>, from: usize, data: &[u8]) -> Vec<u8> {
    for (b, d) in base[from..].iter_mut().zip(data) {
        *b ^= d;
    }
    if data.len() > base.len() - from {
        base.extend_from_slice(&data[base.len() - from..]);
    }
    base
}

/// The guest's port I/O: the real PIO bus (COM1, i8042, debug exit, ACPI
/// sleep/reset) driven by 6-byte ops `[kind, port lo, port hi, v0, v1,
/// v2]`. Invariants: every byte the guest sends through COM1's transmit
/// register (DLAB and loopback off) reaches the console ring and the sink
/// in order; the ring holds at most its capacity and tails correctly; the
/// VM exit latched is the first one the guest asked for.
pub fn pio_case(data: &[u8]) {
    let Some((&cap, rest)) = data.split_first() else {
        return;
    };
    let cap = usize::from(cap % 64) + 1;
    let Ok(exit) = ExitLatch::new() else {
        return;
    };
    let Ok(irq) = EventFd::new(libc::EFD_NONBLOCK) else {
        return;
    };
    let ring = ConsoleRing::new(cap);
    let sunk = Arc::new(Mutex::new(Vec::new()));
    let s2 = sunk.clone();
    let sink = SerialSink::Callback(Box::new(move |b: &[u8]| {
        s2.lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend_from_slice(b)
    }));
    let serial = Arc::new(Mutex::new(SerialDevice::new(
        irq,
        SerialOut::new(ring.clone(), sink),
    )));
    let mut pio = Bus::default();
    insert_pio_devices(&mut pio, serial.clone(), &exit);
    let com1 = u64::from(layout::COM1_PORT);
    let (mut lcr, mut mcr) = (0u8, 0u8);
    let mut sent = Vec::new();
    let mut want_exit: Option<ExitReason> = None;
    let mut last_total = 0;
    for op in rest.chunks_exact(6) {
        // Bias ports toward the devices.
        let port = match op[0] & 7 {
            0..=2 => com1 + u64::from(op[1] % 8),
            3 => u64::from(layout::I8042_PORT) + u64::from(op[1] % 6),
            4 => u64::from(layout::DEBUG_EXIT_PORT) + u64::from(op[1] % 5),
            5 => u64::from(layout::ACPI_PM_PORT) + u64::from(op[1] % 2),
            _ => u64::from(u16::from_le_bytes([op[1], op[2]])),
        };
        let len = [1usize, 1, 2, 4][usize::from(op[0] >> 3 & 3)];
        let val = [op[3], op[4], op[5], 0];
        if op[0] & 0x20 != 0 {
            let mut b = [0u8; 4];
            let claimed = pio.read(port, &mut b[..len]);
            if !claimed {
                assert!(b[..len].iter().all(|&x| x == 0xff));
            }
        } else if op[0] & 0x40 != 0 {
            serial
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .enqueue_input(&op[3..]);
        } else {
            pio.write(port, &val[..len]);
            // The model of what the write does.
            if want_exit.is_none() {
                want_exit = match port {
                    p if p == u64::from(layout::I8042_PORT) + 4 && val[0] == 0xfe => {
                        Some(ExitReason::Reset)
                    }
                    p if p == u64::from(layout::DEBUG_EXIT_PORT) => {
                        let mut b = [0u8; 4];
                        b[..len].copy_from_slice(&val[..len]);
                        Some(ExitReason::DebugExit {
                            code: u32::from_le_bytes(b),
                        })
                    }
                    p if p == u64::from(layout::ACPI_PM_PORT) && val[0] == S5_SLEEP_VALUE => {
                        Some(ExitReason::Shutdown)
                    }
                    p if p == u64::from(layout::ACPI_PM_PORT) && val[0] == RESET_VALUE => {
                        Some(ExitReason::Reset)
                    }
                    _ => None,
                };
            }
            if len == 1 {
                match port.wrapping_sub(com1) {
                    0 if lcr & 0x80 == 0 && mcr & 0x10 == 0 => sent.push(val[0]),
                    3 => lcr = val[0],
                    4 => mcr = val[0],
                    _ => {}
                }
            }
        }
        let total = ring.total();
        assert!(total >= last_total);
        last_total = total;
        assert!(ring.contents().len() <= cap);
    }
    assert_eq!(exit.reason(), want_exit, "latched exit");
    assert_eq!(ring.total(), sent.len() as u64, "bytes on the console");
    let held = ring.contents();
    assert!(sent.ends_with(&held), "the ring holds the newest output");
    for pos in [0, last_total / 2, last_total, last_total + 7, u64::MAX] {
        let (tail, next) = ring.read_from(pos);
        assert_eq!(next, last_total);
        assert!(held.ends_with(&tail));
        let start = last_total - held.len() as u64;
        assert_eq!(tail.len() as u64, last_total - pos.clamp(start, last_total));
    }
    serial.lock().unwrap_or_else(|p| p.into_inner()).flush();
    assert_eq!(*sunk.lock().unwrap_or_else(|p| p.into_inner()), sent);
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn the_disk_seed_boots() {
        let backend: Arc<dyn BlockBackend> =
            Arc::new(MemBackend::from_bytes(DISK_SEED.to_vec(), "seed"));
        let f = disk::find(Arc::new(SyncAdapter::new(backend)), 0, None).unwrap();
        assert_eq!(f.kernel_path, "partition 1:/boot/vmlinuz-6.1.0-1-amd64");
        assert_eq!(f.root_uuid, "4a3c1b2e-0d3f-4e5a-9b8c-7d6e5f4a3b2c");
        assert_eq!(f.initramfs.as_deref().map(<[u8]>::len), Some(64));
    }

    #[test]
    fn the_kernel_templates_load() {
        for (mode, want_pvh) in [(0b0100u8, false), (0b1000, false)] {
            let mem =
                crate::memory::GuestMemory::from_ranges(&[(GuestAddress(0), KERNEL_MEM)]).unwrap();
            let kernel = if mode == 0b0100 {
                bzimage_template()
            } else {
                elf_template()
            };
            let files = DiskBootFiles {
                kernel,
                kernel_path: "k".into(),
                initramfs: Some(vec![1; 4096]),
                initramfs_path: None,
                root_uuid: String::new(),
                root_partition: 1,
                bytes_read: 0,
            };
            let l = boot::load(
                &mem,
                &KernelConfig::default(),
                BootFiles::Disk(&files),
                "x",
                0,
            )
            .unwrap();
            assert_eq!(matches!(l.entry, Entry::Pvh { .. }), want_pvh);
            assert!(l.initramfs.is_some());
            kernel_load_case(&[mode | 2]);
        }
    }

    #[test]
    fn pio_model_sees_console_bytes_and_exits() {
        // "hi" on COM1, then a debug exit of 3, then a reset that must not win.
        let op = |kind: u8, off: u8, v: u8| [kind, off, 0, v, 0, 0];
        let mut data = vec![16];
        data.extend(op(0, 0, b'h'));
        data.extend(op(0, 0, b'i'));
        data.extend(op(4, 0, 3));
        data.extend(op(3, 4, 0xfe));
        pio_case(&data);
    }

    fn patches() -> impl Strategy<Value = Vec<u8>> {
        // Patches mostly inside the first 40 KiB: the MBR, superblock,
        // group descriptors, bitmaps, inode table and directories.
        prop::collection::vec(
            (0u32..0xa000, prop::collection::vec(any::<u8>(), 1..8)),
            1..6,
        )
        .prop_map(|ps| {
            let mut v = vec![0u8];
            for (off, bytes) in ps {
                v.extend_from_slice(&off.to_le_bytes()[..3]);
                v.push(bytes.len() as u8);
                v.extend(bytes);
            }
            v
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn fuzz_disk_boot_mutated_seed(data in patches()) {
            disk_boot_case(&data);
        }

        #[test]
        fn fuzz_disk_boot_raw(data in prop::collection::vec(any::<u8>(), 0..4096)) {
            let mut d = vec![1u8];
            d.extend(data);
            disk_boot_case(&d);
        }

        #[test]
        fn fuzz_kernel_load(mode in any::<u8>(), data in prop::collection::vec(any::<u8>(), 0..0x300)) {
            // Sparse XOR masks keep most of a template's header valid.
            let sparse: Vec<u8> = data.iter().map(|&b| if b < 0xe0 { 0 } else { b }).collect();
            let mut d = vec![mode];
            d.extend(if (mode >> 2) & 3 == 0 { data } else { sparse });
            kernel_load_case(&d);
        }

        #[test]
        fn fuzz_pio(data in prop::collection::vec(any::<u8>(), 1..600)) {
            pio_case(&data);
        }
    }
}
