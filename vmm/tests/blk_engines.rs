// SPDX-License-Identifier: Apache-2.0
//! The same virtio-blk suite over every file I/O engine (inline, thread
//! pool, io_uring buffered, io_uring with O_DIRECT): many requests in
//! flight against a real image file, verified against a model; flush
//! ordered after earlier writes; discard / write-zeroes / get-id; a reset
//! with requests in flight.
#![allow(clippy::unwrap_used)]

use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use sheaf_vmm::FileBackend;
use sheaf_vmm::devices::virtio::block::{
    AsyncBlockBackend, IoUringBackend, SyncAdapter, ThreadPoolBackend,
};
use sheaf_vmm::devices::virtio::test_utils::{DATA, Driver, RawDesc, USED};
use vm_memory::{Bytes, GuestAddress};

const NEXT: u16 = 1;
const WRITE: u16 = 2;
const MEM: usize = 8 << 20;
const DISK: u64 = 4 << 20;
const T_IN: u32 = 0;
const T_OUT: u32 = 1;
const T_FLUSH: u32 = 4;
const T_GET_ID: u32 = 8;
const T_DISCARD: u32 = 11;
const T_WRITE_ZEROES: u32 = 13;
/// Guest memory per request slot.
const SLOT: u64 = 0x2_0000;

#[derive(Debug, Clone, Copy)]
enum Engine {
    Sync,
    Threads,
    Uring,
    UringDirect,
}

const ENGINES: [Engine; 4] = [
    Engine::Sync,
    Engine::Threads,
    Engine::Uring,
    Engine::UringDirect,
];

fn direct_possible(dir: &Path) -> bool {
    let p = dir.join("probe");
    std::fs::write(&p, [0u8; 4096]).unwrap();
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(&p)
        .is_ok()
}

fn open(e: Engine, path: &Path) -> Arc<dyn AsyncBlockBackend> {
    let file = || Arc::new(FileBackend::open(path, false, Some("engine-disk".into())).unwrap());
    match e {
        Engine::Sync => Arc::new(SyncAdapter::new(file())),
        Engine::Threads => Arc::new(ThreadPoolBackend::new(file(), 4).unwrap()),
        Engine::Uring | Engine::UringDirect => {
            let direct = matches!(e, Engine::UringDirect);
            let b = IoUringBackend::open(path, false, Some("engine-disk".into()), direct)
                .expect("io_uring available on this host");
            if direct && direct_possible(path.parent().unwrap()) {
                assert!(b.uses_direct(), "O_DIRECT descriptor opened");
            }
            Arc::new(b)
        }
    }
}

/// xorshift64*: deterministic test data without a dependency.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

struct Rig {
    d: Driver,
    _dir: tempfile::TempDir,
    path: std::path::PathBuf,
    model: Vec<u8>,
}

fn rig(e: Engine) -> Rig {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("disk.img");
    let mut rng = Rng(0x5eed);
    let model: Vec<u8> = (0..DISK).map(|_| rng.next() as u8).collect();
    std::fs::write(&path, &model).unwrap();
    let mut d = Driver::new_async(open(e, &path), MEM);
    assert!(d.negotiate((1 << 13) | (1 << 14)));
    d.setup_queue(128);
    Rig {
        d,
        _dir: dir,
        path,
        model,
    }
}

fn slot(i: u16) -> u64 {
    DATA + u64::from(i) * SLOT
}

fn status_addr(i: u16) -> u64 {
    slot(i) + 0x100
}

/// Posts request `i` (descriptors 4i..4i+3): header, `data` segments
/// (guest address, length), status byte preset to 0xff.
fn post(d: &mut Driver, i: u16, ty: u32, sector: u64, data: &[(u64, u32)]) {
    let h = 4 * i;
    d.header(slot(i), ty, sector);
    let dev_writes = matches!(ty, T_IN | T_GET_ID);
    d.set_desc(
        h,
        RawDesc {
            addr: slot(i),
            len: 16,
            flags: NEXT,
            next: h + 1,
        },
    );
    let mut k = h + 1;
    for &(addr, len) in data {
        d.set_desc(
            k,
            RawDesc {
                addr,
                len,
                flags: NEXT | if dev_writes { WRITE } else { 0 },
                next: k + 1,
            },
        );
        k += 1;
    }
    d.set_desc(
        k,
        RawDesc {
            addr: status_addr(i),
            len: 1,
            flags: WRITE,
            next: 0,
        },
    );
    d.mem
        .write_obj(0xffu8, GuestAddress(status_addr(i)))
        .unwrap();
    d.kick(h);
}

fn status_of(d: &Driver, i: u16) -> u8 {
    d.mem.read_obj(GuestAddress(status_addr(i))).unwrap()
}

/// Plays the device thread until `want` used entries are there.
fn run_until_used(d: &mut Driver, want: u16) {
    let done = d.run_until_used(want, Duration::from_secs(20));
    assert!(done, "only {} of {want} completed", d.used_idx());
}

/// A random request in region `i` of 32: sector range and two buffer
/// segments, 4 KiB aligned (O_DIRECT-eligible) or deliberately not.
fn random_io(rng: &mut Rng, i: u16) -> (u64, Vec<(u64, u32)>) {
    let region = DISK / 512 / 32;
    let sectors = 1 + rng.below(64);
    let aligned = rng.below(2) == 0;
    let sector = if aligned {
        u64::from(i) * region + 8 * rng.below((region - 64) / 8)
    } else {
        u64::from(i) * region + rng.below(region - 64)
    };
    let len = (sectors * 512) as u32;
    let buf = slot(i) + 0x1000 + if aligned { 0 } else { 3 };
    let cut = if aligned && len >= 8192 {
        4096 * (1 + rng.below(u64::from(len) / 4096 - 1)) as u32
    } else {
        1 + rng.below(u64::from(len) - 1) as u32
    };
    let segs = if len > 1 && rng.below(3) != 0 {
        // Second segment somewhere else in the slot, page aligned.
        vec![(buf, cut), (slot(i) + 0x1_0000, len - cut)]
    } else {
        vec![(buf, len)]
    };
    (sector, segs)
}

fn fill(d: &Driver, segs: &[(u64, u32)], rng: &mut Rng) -> Vec<u8> {
    let mut all = Vec::new();
    for &(a, l) in segs {
        let bytes: Vec<u8> = (0..l).map(|_| rng.next() as u8).collect();
        d.mem.write_slice(&bytes, GuestAddress(a)).unwrap();
        all.extend(bytes);
    }
    all
}

fn gather(d: &Driver, segs: &[(u64, u32)]) -> Vec<u8> {
    let mut all = Vec::new();
    for &(a, l) in segs {
        let mut b = vec![0u8; l as usize];
        d.mem.read_slice(&mut b, GuestAddress(a)).unwrap();
        all.extend(b);
    }
    all
}

fn integrity(e: Engine) {
    let mut r = rig(e);
    let mut rng = Rng(0xdead_beef ^ e as u64);
    const N: u16 = 32;
    let mut ios = Vec::new();
    for i in 0..N {
        let (sector, segs) = random_io(&mut rng, i);
        let data = fill(&r.d, &segs, &mut rng);
        let off = (sector * 512) as usize;
        r.model[off..off + data.len()].copy_from_slice(&data);
        post(&mut r.d, i, T_OUT, sector, &segs);
        ios.push((sector, segs));
    }
    run_until_used(&mut r.d, N);
    for i in 0..N {
        assert_eq!(status_of(&r.d, i), 0, "{e:?}: write {i}");
    }
    // Read every range back (into poisoned buffers, again in flight
    // together), plus the start of the disk through odd segments.
    for (i, (sector, segs)) in ios.iter().enumerate() {
        for &(a, l) in segs {
            r.d.mem
                .write_slice(&vec![0xa5; l as usize], GuestAddress(a))
                .unwrap();
        }
        post(&mut r.d, i as u16, T_IN, *sector, segs);
    }
    run_until_used(&mut r.d, 2 * N);
    let mut lens = std::collections::HashMap::new();
    for k in N..2 * N {
        let (head, len) = r.d.used_elem(k);
        lens.insert(head, len);
    }
    for (i, (sector, segs)) in ios.iter().enumerate() {
        assert_eq!(status_of(&r.d, i as u16), 0, "{e:?}: read {i}");
        let got = gather(&r.d, segs);
        let off = (*sector * 512) as usize;
        assert!(
            got == r.model[off..off + got.len()],
            "{e:?}: read {i} returns what was written"
        );
        assert_eq!(
            lens.get(&(4 * i as u32)).copied(),
            Some(got.len() as u32 + 1),
            "{e:?}: used length of read {i}"
        );
    }
    let on_disk = std::fs::read(&r.path).unwrap();
    assert!(on_disk == r.model, "{e:?}: image file matches the model");
}

#[test]
fn random_writes_in_flight_then_reads_match_a_model_on_every_engine() {
    for e in ENGINES {
        integrity(e);
    }
}

fn flush_after_writes(e: Engine) {
    let mut r = rig(e);
    let mut rng = Rng(7);
    const W: u16 = 24;
    for i in 0..W {
        let (sector, segs) = random_io(&mut rng, i);
        let data = fill(&r.d, &segs, &mut rng);
        let off = (sector * 512) as usize;
        r.model[off..off + data.len()].copy_from_slice(&data);
        post(&mut r.d, i, T_OUT, sector, &segs);
    }
    post(&mut r.d, W, T_FLUSH, 0, &[]);
    run_until_used(&mut r.d, W + 1);
    let order: Vec<u32> = (0..=W).map(|k| r.d.used_elem(k).0).collect();
    assert_eq!(
        order.last().copied(),
        Some(4 * u32::from(W)),
        "{e:?}: the flush completes after every write submitted before it: {order:?}"
    );
    assert_eq!(status_of(&r.d, W), 0, "{e:?}: flush status");
    let file = std::fs::File::open(&r.path).unwrap();
    let mut back = vec![0u8; DISK as usize];
    file.read_exact_at(&mut back, 0).unwrap();
    assert!(back == r.model, "{e:?}: flushed image matches the model");
}

#[test]
fn flush_completes_after_earlier_writes_on_every_engine() {
    for e in ENGINES {
        flush_after_writes(e);
    }
}

fn ranges_and_id(e: Engine) {
    let mut r = rig(e);
    // Discard sectors 8..16, zero 100..104 (no unmap) and 200..201 (unmap).
    let desc = |d: &Driver, at: u64, sector: u64, num: u32, flags: u32| {
        d.mem.write_obj(sector, GuestAddress(at)).unwrap();
        d.mem.write_obj(num, GuestAddress(at + 8)).unwrap();
        d.mem.write_obj(flags, GuestAddress(at + 12)).unwrap();
    };
    let a = slot(0) + 0x1000;
    desc(&r.d, a, 8, 8, 0);
    post(&mut r.d, 0, T_DISCARD, 0, &[(a, 16)]);
    let b = slot(1) + 0x1000;
    desc(&r.d, b, 100, 4, 0);
    desc(&r.d, b + 16, 200, 1, 1);
    post(&mut r.d, 1, T_WRITE_ZEROES, 0, &[(b, 32)]);
    let c = slot(2) + 0x1000;
    post(&mut r.d, 2, T_GET_ID, 0, &[(c, 20)]);
    // A range past the end is an I/O error, not a host failure.
    let z = slot(3) + 0x1000;
    desc(&r.d, z, DISK / 512 - 1, 2, 0);
    post(&mut r.d, 3, T_WRITE_ZEROES, 0, &[(z, 16)]);
    run_until_used(&mut r.d, 4);
    assert_eq!(status_of(&r.d, 0), 0, "{e:?}: discard");
    assert_eq!(status_of(&r.d, 1), 0, "{e:?}: write zeroes");
    assert_eq!(status_of(&r.d, 2), 0, "{e:?}: get id");
    assert_eq!(status_of(&r.d, 3), 1, "{e:?}: range past the end");
    let mut id = [0u8; 20];
    r.d.mem.read_slice(&mut id, GuestAddress(c)).unwrap();
    assert_eq!(&id[..11], b"engine-disk");
    assert!(id[11..].iter().all(|&b| b == 0));
    let on_disk = std::fs::read(&r.path).unwrap();
    assert_eq!(on_disk.len() as u64, DISK, "{e:?}: size kept");
    for (s, n) in [(8usize, 8usize), (100, 4), (200, 1)] {
        assert!(
            on_disk[s * 512..(s + n) * 512].iter().all(|&b| b == 0),
            "{e:?}: sectors {s}..{} read back as zeroes",
            s + n
        );
    }
    assert!(on_disk[16 * 512..100 * 512] == r.model[16 * 512..100 * 512]);
    assert!(on_disk[7 * 512..8 * 512] == r.model[7 * 512..8 * 512]);
}

#[test]
fn discard_write_zeroes_and_get_id_on_every_engine() {
    for e in ENGINES {
        ranges_and_id(e);
    }
}

fn reset_mid_io(e: Engine) {
    let mut r = rig(e);
    let mut rng = Rng(99);
    const N: u16 = 32;
    for i in 0..N {
        let (sector, segs) = random_io(&mut rng, i);
        fill(&r.d, &segs, &mut rng);
        post(
            &mut r.d,
            i,
            if i % 2 == 0 { T_OUT } else { T_IN },
            sector,
            &segs,
        );
    }
    let before_reset = r.d.used_idx();
    r.d.w(0x70, 0);
    // Reset returned: the engine let go of every buffer.
    let mut before = vec![0u8; MEM];
    r.d.mem.read_slice(&mut before, GuestAddress(0)).unwrap();
    std::thread::sleep(Duration::from_millis(30));
    let _ = r.d.transport.queue_evts()[0].read();
    r.d.transport.notify(0);
    let mut after = vec![0u8; MEM];
    r.d.mem.read_slice(&mut after, GuestAddress(0)).unwrap();
    assert!(before == after, "{e:?}: guest memory changed after reset");
    assert_eq!(
        r.d.used_idx(),
        before_reset,
        "{e:?}: no completion after reset"
    );

    // A fresh setup works.
    assert!(r.d.negotiate(0));
    r.d.set_avail_idx(0);
    r.d.mem.write_obj(0u16, GuestAddress(USED + 2)).unwrap();
    r.d.setup_queue(128);
    let buf = slot(0) + 0x1000;
    r.d.mem
        .write_slice(&[0x5a; 4096], GuestAddress(buf))
        .unwrap();
    post(&mut r.d, 0, T_OUT, 4000, &[(buf, 4096)]);
    run_until_used(&mut r.d, 1);
    assert_eq!(status_of(&r.d, 0), 0);
    let back = std::fs::read(&r.path).unwrap();
    assert!(
        back[4000 * 512..4000 * 512 + 4096]
            .iter()
            .all(|&b| b == 0x5a)
    );
}

#[test]
fn reset_with_requests_in_flight_on_every_engine() {
    for e in ENGINES {
        reset_mid_io(e);
    }
}

fn short_read(e: Engine) {
    let mut r = rig(e);
    // The image shrinks under the running device: a read across the new
    // end gets a short transfer, then nothing. That is an I/O error, never
    // a success with stale bytes in the buffer.
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&r.path)
        .unwrap();
    f.set_len(512 * 1024 + 1000).unwrap();
    let buf = slot(0) + 0x1000;
    post(&mut r.d, 0, T_IN, 1024, &[(buf, 8192)]);
    // A write there extends the file again and succeeds.
    let wbuf = slot(1) + 0x1000;
    r.d.mem
        .write_slice(&[0x77; 4096], GuestAddress(wbuf))
        .unwrap();
    run_until_used(&mut r.d, 1);
    assert_eq!(status_of(&r.d, 0), 1, "{e:?}: short read is IOERR");
    assert_eq!(
        r.d.used_elem(0).1,
        1,
        "{e:?}: only the status byte reported"
    );
    post(&mut r.d, 1, T_OUT, 2048, &[(wbuf, 4096)]);
    run_until_used(&mut r.d, 2);
    assert_eq!(status_of(&r.d, 1), 0, "{e:?}: write");
    // Reads inside the remaining file still work.
    post(&mut r.d, 2, T_IN, 8, &[(buf, 4096)]);
    run_until_used(&mut r.d, 3);
    assert_eq!(status_of(&r.d, 2), 0, "{e:?}: read inside");
    let mut got = vec![0u8; 4096];
    r.d.mem.read_slice(&mut got, GuestAddress(buf)).unwrap();
    assert!(got == r.model[8 * 512..8 * 512 + 4096]);
}

#[test]
fn read_across_a_shrunk_image_is_an_io_error_on_every_engine() {
    for e in ENGINES {
        short_read(e);
    }
}

/// Pages in a dirty log, as guest addresses.
fn dirty_pages(log: &[sheaf_vmm::DirtyRegion]) -> Vec<u64> {
    let mut pages = Vec::new();
    for r in log {
        for (wi, w) in r.bitmap.iter().enumerate() {
            for b in 0..64u64 {
                if w & (1 << b) != 0 {
                    pages.push(r.guest_addr + (wi as u64 * 64 + b) * 4096);
                }
            }
        }
    }
    pages
}

/// What the device writes into guest memory serving a read (the data
/// buffers, the used ring) is in vm-memory's dirty
/// bitmap afterwards on every engine, io_uring's kernel-side writes
/// included (live migration resends these pages).
#[test]
fn a_read_marks_every_page_the_device_wrote_dirty_on_every_engine() {
    use sheaf_vmm::memory::take_vmm_dirty;
    for e in ENGINES {
        let mut r = rig(e);
        // Page-aligned 8 KiB (O_DIRECT-eligible) plus 512 bytes elsewhere.
        let segs = [(slot(0) + 0x1000, 8192), (slot(0) + 0x1_0000, 512)];
        // The driver's own writes (header, status preset, rings) are not
        // checked; nothing here writes the data pages or the used ring.
        take_vmm_dirty(&r.d.mem);
        post(&mut r.d, 0, T_IN, 8, &segs);
        run_until_used(&mut r.d, 1);
        assert_eq!(status_of(&r.d, 0), 0, "{e:?}");
        let got = gather(&r.d, &segs);
        assert_eq!(got[..], r.model[8 * 512..8 * 512 + 8704], "{e:?}");
        let pages = dirty_pages(&take_vmm_dirty(&r.d.mem));
        for p in [slot(0) + 0x1000, slot(0) + 0x2000, slot(0) + 0x1_0000, USED] {
            assert!(
                pages.contains(&p),
                "{e:?}: page {p:#x} not dirty in {pages:x?}"
            );
        }
        assert!(!pages.contains(&(slot(0) + 0x3000)), "{e:?}: {pages:x?}");
        assert!(dirty_pages(&take_vmm_dirty(&r.d.mem)).is_empty());
    }
}
