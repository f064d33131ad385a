// SPDX-License-Identifier: Apache-2.0
//! The C ABI driven from Rust through the exported functions themselves:
//! what `docs/bindings-c.md` promises about threads, states and errors.
//! (The C programs in examples/c and tests/misuse.c run under valgrind in
//! scripts/test.d/bindings-c.)

use std::ffi::{CStr, CString, c_char};
use std::ptr;
use std::time::{Duration, Instant};

use sheaf::*;

fn kvm() -> bool {
    let ok = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_ok();
    if !ok {
        eprintln!("SKIP: no /dev/kvm");
    }
    ok
}

fn last_error() -> String {
    let p = sheaf_last_error();
    assert!(!p.is_null(), "no last error recorded");
    // SAFETY: a non-NULL last error is a live thread-local C string.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

fn c(s: &str) -> CString {
    CString::new(s).expect("no NUL")
}

/// Wraps a handle so it can move to another thread (the C contract allows
/// it; the raw pointer type is not `Send`).
#[derive(Clone, Copy)]
struct Handle(usize);
// SAFETY: a handle is a registry token, never dereferenced; every function
// that takes one is thread-safe (per-handle locks).
unsafe impl Send for Handle {}

fn probe_vm(cmdline: &str) -> *mut sheaf_vm {
    let mut vm = ptr::null_mut();
    let name = c("abi-test");
    // SAFETY: valid C strings and out-pointer.
    unsafe {
        assert_eq!(sheaf_vm_new(name.as_ptr(), &mut vm), SHEAF_OK);
        assert_eq!(sheaf_vm_set_memory_mib(vm, 64), SHEAF_OK);
        assert_eq!(sheaf_vm_set_kernel(vm, sheaf_probe_guest_path()), SHEAF_OK);
        assert_eq!(
            sheaf_vm_set_cmdline(vm, c(cmdline).as_ptr()),
            SHEAF_OK,
            "{}",
            last_error()
        );
    }
    vm
}

#[test]
fn free_from_another_thread_releases_a_waiter() {
    if !kvm() {
        return;
    }
    let vm = probe_vm("console=ttyS0 probe.halt=1");
    assert_eq!(sheaf_vm_start(vm), SHEAF_OK, "{}", last_error());
    let h = Handle(vm.addr());
    let waiter = std::thread::spawn(move || {
        let mut ex = std::mem::MaybeUninit::<sheaf_exit>::uninit();
        let vm: *mut sheaf_vm = ptr::without_provenance_mut(h.0);
        // SAFETY: `ex` is writable; the handle may be freed meanwhile, which
        // the library handles (the waiter holds its own reference).
        let rc = unsafe { sheaf_vm_wait(vm, 30_000, ex.as_mut_ptr()) };
        // SAFETY: sheaf_vm_wait always initialises `ex`.
        (rc, unsafe { ex.assume_init() }.kind)
    });
    std::thread::sleep(Duration::from_millis(100));
    // Pause and resume from this thread while the other one waits.
    assert_eq!(sheaf_vm_pause(vm), SHEAF_OK, "{}", last_error());
    assert_eq!(sheaf_vm_resume(vm), SHEAF_OK, "{}", last_error());
    let t = Instant::now();
    assert_eq!(sheaf_vm_free(vm), SHEAF_OK);
    let (rc, kind) = waiter.join().expect("waiter thread");
    assert_eq!((rc, kind), (SHEAF_OK, SHEAF_EXIT_STOPPED));
    assert!(t.elapsed() < Duration::from_secs(10));
    assert_eq!(sheaf_vm_free(vm), SHEAF_EBADF, "double free");
}

#[test]
fn console_tail_and_state_errors() {
    if !kvm() {
        return;
    }
    let vm = probe_vm("console=ttyS0 probe.token=abi");
    let mut state = 99;
    // SAFETY: valid out-pointer.
    assert_eq!(unsafe { sheaf_vm_state(vm, &mut state) }, SHEAF_OK);
    assert_eq!(state, SHEAF_VM_CREATED);
    // Waiting for a VM that never started is a state error.
    // SAFETY: NULL exit is allowed.
    let rc = unsafe { sheaf_vm_wait(vm, 0, ptr::null_mut()) };
    assert_eq!(rc, SHEAF_ESTATE);
    assert_eq!(sheaf_vm_start(vm), SHEAF_OK, "{}", last_error());
    // SAFETY: NULL exit is allowed.
    let rc = unsafe { sheaf_vm_wait(vm, 60_000, ptr::null_mut()) };
    assert_eq!(rc, SHEAF_OK);
    // Tail the console in small pieces.
    let mut all = Vec::new();
    let mut pos = 0u64;
    loop {
        let mut buf = [0u8; 16];
        let (mut n, mut next) = (0usize, 0u64);
        // SAFETY: `buf` is writable for its length; outs are valid.
        let rc = unsafe {
            sheaf_vm_console_read(vm, pos, buf.as_mut_ptr(), buf.len(), &mut n, &mut next)
        };
        assert_eq!(rc, SHEAF_OK);
        if n == 0 {
            break;
        }
        all.extend_from_slice(&buf[..n]);
        pos = next;
    }
    let text = String::from_utf8_lossy(&all);
    assert!(
        text.contains("token: abi") && text.contains("probe: PASS"),
        "{text}"
    );
    let mut out: *mut c_char = ptr::null_mut();
    // SAFETY: valid out-pointer.
    assert_eq!(unsafe { sheaf_vm_console(vm, &mut out) }, SHEAF_OK);
    // SAFETY: a string the library returned.
    let whole = unsafe { CStr::from_ptr(out) }
        .to_string_lossy()
        .into_owned();
    assert_eq!(whole.as_bytes(), &all[..]);
    assert_eq!(sheaf_string_free(out), SHEAF_OK);
    assert_eq!(sheaf_vm_set_vcpus(vm, 2), SHEAF_ESTATE);
    assert!(last_error().contains("stopped"), "{}", last_error());
    assert_eq!(sheaf_vm_free(vm), SHEAF_OK);
}

#[test]
fn volume_round_trip_and_bad_arguments() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = c(dir.path().join("v").to_str().expect("utf-8 path"));
    // SAFETY: valid C strings and out-pointers throughout.
    unsafe {
        assert_eq!(sheaf_volume_create(path.as_ptr(), 1 << 20), SHEAF_OK);
        let mut vol = ptr::null_mut();
        assert_eq!(sheaf_volume_open_local(path.as_ptr(), &mut vol), SHEAF_OK);
        let data = b"abi bytes";
        assert_eq!(
            sheaf_volume_write(vol, 4095, data.as_ptr(), data.len()),
            SHEAF_OK
        );
        assert_eq!(sheaf_volume_flush(vol), SHEAF_OK);
        let mut back = [0u8; 9];
        assert_eq!(
            sheaf_volume_read(vol, 4095, back.as_mut_ptr(), back.len()),
            SHEAF_OK
        );
        assert_eq!(&back, data);
        assert_eq!(
            sheaf_volume_read(vol, (1 << 20) - 4, back.as_mut_ptr(), back.len()),
            SHEAF_EINVAL
        );
        assert_eq!(
            sheaf_volume_write(vol, 0, ptr::null(), 5),
            SHEAF_EINVAL,
            "NULL buffer"
        );
        assert_eq!(sheaf_volume_close(vol), SHEAF_OK);
        assert_eq!(sheaf_volume_flush(vol), SHEAF_EBADF);
    }
}
