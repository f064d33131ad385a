// SPDX-License-Identifier: Apache-2.0
//! virtio-blk with requests in flight: an asynchronous backend (worker
//! threads over a real disk model) completing out of order, bad chains mixed
//! in, and a reset while requests are still running.
#![allow(clippy::unwrap_used)]

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use sheaf_vmm::MemBackend;
use sheaf_vmm::devices::virtio::block::ThreadPoolBackend;
use sheaf_vmm::devices::virtio::block::backend::BlockBackend;
use sheaf_vmm::devices::virtio::mmio::status;
use sheaf_vmm::devices::virtio::test_utils::{DATA, Driver, RawDesc};
use vm_memory::{Bytes, GuestAddress};

const NEXT: u16 = 1;
const WRITE: u16 = 2;
const MEM: usize = 1 << 20;
const SECTORS: u64 = 64;

/// MemBackend with latency: requests on even sectors wait `slow`, and every
/// request waits until the gate is open.
struct Latency {
    inner: MemBackend,
    slow: Duration,
    gate: (Mutex<bool>, Condvar),
    started: AtomicBool,
}

impl Latency {
    fn new(slow: Duration, open: bool) -> Self {
        Latency {
            inner: MemBackend::new(SECTORS * 512, "lat"),
            slow,
            gate: (Mutex::new(open), Condvar::new()),
            started: AtomicBool::new(false),
        }
    }
    fn wait(&self, offset: u64) {
        self.started.store(true, Ordering::SeqCst);
        let mut open = self.gate.0.lock().unwrap();
        while !*open {
            open = self.gate.1.wait(open).unwrap();
        }
        drop(open);
        if (offset / 512).is_multiple_of(2) {
            std::thread::sleep(self.slow);
        }
    }
    fn open(&self) {
        *self.gate.0.lock().unwrap() = true;
        self.gate.1.notify_all();
    }
}

impl BlockBackend for Latency {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn device_id(&self) -> String {
        self.inner.device_id()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.wait(offset);
        self.inner.read_at(offset, buf)
    }
    fn write_at(&self, offset: u64, buf: &[u8]) -> io::Result<()> {
        self.wait(offset);
        self.inner.write_at(offset, buf)
    }
    fn flush(&self) -> io::Result<()> {
        self.inner.flush()
    }
}

fn slot(i: u16) -> u64 {
    DATA + u64::from(i) * 0x1000
}

/// Request `i` uses descriptors 3i..3i+2: header at slot+0x900, 512 data
/// bytes at slot, status at slot+0x800 (preset to 0xff).
fn post(d: &mut Driver, i: u16, ty: u32, sector: u64) {
    let (base, h) = (slot(i), 3 * i);
    d.header(base + 0x900, ty, sector);
    let data_flags = if ty == 0 { WRITE } else { 0 };
    d.set_desc(
        h,
        RawDesc {
            addr: base + 0x900,
            len: 16,
            flags: NEXT,
            next: h + 1,
        },
    );
    d.set_desc(
        h + 1,
        RawDesc {
            addr: base,
            len: 512,
            flags: data_flags | NEXT,
            next: h + 2,
        },
    );
    d.set_desc(
        h + 2,
        RawDesc {
            addr: base + 0x800,
            len: 1,
            flags: WRITE,
            next: 0,
        },
    );
    d.mem.write_obj(0xffu8, GuestAddress(base + 0x800)).unwrap();
    d.kick(h);
}

fn status_of(d: &Driver, i: u16) -> u8 {
    d.mem.read_obj(GuestAddress(slot(i) + 0x800)).unwrap()
}

/// Plays the device thread until `want` used entries are there.
fn run_until_used(d: &mut Driver, want: u16) {
    let done = d.run_until_used(want, Duration::from_secs(20));
    assert!(done, "only {} of {want} completed", d.used_idx());
}

fn ready(backend: Arc<Latency>, threads: usize) -> Driver {
    let pool = ThreadPoolBackend::new(backend, threads).unwrap();
    let mut d = Driver::new_async(Arc::new(pool), MEM);
    assert!(d.negotiate(0));
    d.setup_queue(128);
    assert_eq!(d.status() & status::DRIVER_OK, status::DRIVER_OK);
    d
}

#[test]
fn many_requests_in_flight_complete_out_of_order_and_all_once() {
    let disk = Arc::new(Latency::new(Duration::from_millis(30), true));
    let mut d = ready(disk.clone(), 4);
    const N: u16 = 32;
    for i in 0..N {
        d.mem
            .write_slice(&[i as u8 + 1; 512], GuestAddress(slot(i)))
            .unwrap();
        // Request 7 is out of range: answered at once with IOERR.
        let sector = if i == 7 { SECTORS } else { u64::from(i) };
        post(&mut d, i, 1, sector);
    }
    run_until_used(&mut d, N);
    let mut heads: Vec<u32> = (0..N).map(|k| d.used_elem(k).0).collect();
    let in_order: Vec<u32> = (0..N).map(|i| 3 * u32::from(i)).collect();
    assert_ne!(
        heads, in_order,
        "worker threads overlap: some request overtook another"
    );
    heads.sort_unstable();
    assert_eq!(heads, in_order, "every request completed exactly once");
    for i in 0..N {
        let want = if i == 7 { 1 } else { 0 };
        assert_eq!(status_of(&d, i), want, "status of request {i}");
    }
    let contents = disk.inner.contents();
    for i in (0..N).filter(|&i| i != 7) {
        let s = usize::from(i) * 512;
        assert_eq!(&contents[s..s + 512], &[i as u8 + 1; 512], "sector {i}");
    }

    // Read everything back into zeroed buffers, again overlapped.
    for i in 0..N {
        d.mem.write_slice(&[0; 512], GuestAddress(slot(i))).unwrap();
        post(&mut d, i, 0, u64::from(i) % SECTORS);
    }
    run_until_used(&mut d, 2 * N);
    for i in (0..N).filter(|&i| i != 7) {
        let mut back = [0u8; 512];
        d.mem.read_slice(&mut back, GuestAddress(slot(i))).unwrap();
        assert_eq!(back, [i as u8 + 1; 512], "read back sector {i}");
        assert_eq!(status_of(&d, i), 0);
    }
}

#[test]
fn reset_with_requests_in_flight_writes_nothing_afterwards() {
    let disk = Arc::new(Latency::new(Duration::from_millis(5), false));
    let mut d = ready(disk.clone(), 2);
    const N: u16 = 8;
    for i in 0..N {
        d.mem
            .write_slice(&[0xee; 512], GuestAddress(slot(i)))
            .unwrap();
        post(&mut d, i, 0, u64::from(i));
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while !disk.started.load(Ordering::SeqCst) {
        assert!(Instant::now() < deadline, "backend never started");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(d.used_idx(), 0, "nothing completes while the gate is shut");
    let opener = {
        let disk = disk.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            disk.open();
        })
    };
    // Reset waits for the backend to let go of the buffers.
    d.w(0x70, 0);
    opener.join().unwrap();
    let mut before = vec![0u8; MEM];
    d.mem.read_slice(&mut before, GuestAddress(0)).unwrap();
    assert_eq!(d.used_idx(), 0, "no completion reaches the reset rings");
    std::thread::sleep(Duration::from_millis(50));
    let _ = d.transport.queue_evts()[0].read();
    d.transport.notify(0);
    let mut after = vec![0u8; MEM];
    d.mem.read_slice(&mut after, GuestAddress(0)).unwrap();
    assert!(before == after, "guest memory changed after reset");

    // The device works again after a fresh setup.
    assert!(d.negotiate(0));
    d.set_avail_idx(0);
    d.mem
        .write_obj(
            0u16,
            GuestAddress(sheaf_vmm::devices::virtio::test_utils::USED + 2),
        )
        .unwrap();
    d.setup_queue(128);
    d.mem
        .write_slice(&[0x5a; 512], GuestAddress(slot(0)))
        .unwrap();
    post(&mut d, 0, 1, 9);
    run_until_used(&mut d, 1);
    assert_eq!(status_of(&d, 0), 0);
    assert_eq!(&disk.inner.contents()[9 * 512..10 * 512], &[0x5a; 512]);
}
