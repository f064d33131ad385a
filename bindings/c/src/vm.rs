// SPDX-License-Identifier: Apache-2.0
//! `sheaf_vm`: create, configure, start, pause, resume, stop and wait for a
//! VM; attach disks; read its serial console.

use std::ffi::{c_char, c_int};
use std::sync::OnceLock;
use std::time::Duration;

use sheaf_bindings_core::vm::{Exit, VmHandle, parse_boot_protocol, probe_guest_path};

use crate::args::{bytes_arg, bytes_mut_arg, opt_str_arg, out_arg, put, put_string, str_arg};
use crate::error::{FfiError, FfiResult, SHEAF_ETIMEDOUT, guard, guard_value};
use crate::handle::{Registry, to_ptr, to_token};
use crate::volume::VOLUMES;

/// A virtual machine (opaque).
#[derive(Debug)]
pub struct sheaf_vm {
    _opaque: [u8; 0],
}

pub(crate) static VMS: Registry<VmHandle> = Registry::new(1, "sheaf_vm");

fn get_vm(h: *const sheaf_vm) -> FfiResult<std::sync::Arc<VmHandle>> {
    VMS.get(to_token(h))
}

/// Boot protocol for `sheaf_vm_set_boot_protocol`: Linux 64-bit boot
/// protocol (ELF vmlinux or bzImage), the default.
pub const SHEAF_BOOT_LINUX64: u32 = 0;
/// Boot protocol: Xen PVH (ELF with a PVH note).
pub const SHEAF_BOOT_PVH: u32 = 1;

/// VM state (`sheaf_vm_state`): configured, not started.
pub const SHEAF_VM_CREATED: u32 = 0;
/// VM state: vCPUs running.
pub const SHEAF_VM_RUNNING: u32 = 1;
/// VM state: paused.
pub const SHEAF_VM_PAUSED: u32 = 2;
/// VM state: stopped (see `sheaf_vm_wait` for why).
pub const SHEAF_VM_STOPPED: u32 = 3;

/// Exit kind: a reason this library version does not know.
pub const SHEAF_EXIT_UNKNOWN: u32 = 0;
/// Exit kind: the guest powered off (ACPI S5).
pub const SHEAF_EXIT_SHUTDOWN: u32 = 1;
/// Exit kind: the guest asked for a reset.
pub const SHEAF_EXIT_RESET: u32 = 2;
/// Exit kind: the guest wrote `code` to the debug-exit port 0xf4.
pub const SHEAF_EXIT_DEBUG_EXIT: u32 = 3;
/// Exit kind: a vCPU (`code`) crashed; see `detail`.
pub const SHEAF_EXIT_CRASH: u32 = 4;
/// Exit kind: the VMM failed; see `detail`.
pub const SHEAF_EXIT_INTERNAL_ERROR: u32 = 5;
/// Exit kind: stopped by the host (`sheaf_vm_stop`).
pub const SHEAF_EXIT_STOPPED: u32 = 6;

/// Why a VM stopped.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct sheaf_exit {
    /// One of `SHEAF_EXIT_*`.
    pub kind: u32,
    /// The debug-exit code, or the crashed vCPU; else 0.
    pub code: u32,
    /// True for a clean power-off or a debug exit with code 0.
    pub clean: bool,
    /// NUL-terminated detail for crashes and internal errors (truncated).
    pub detail: [c_char; 128],
}

impl sheaf_exit {
    const EMPTY: sheaf_exit = sheaf_exit {
        kind: SHEAF_EXIT_UNKNOWN,
        code: 0,
        clean: false,
        detail: [0; 128],
    };
}

impl From<&Exit> for sheaf_exit {
    fn from(e: &Exit) -> sheaf_exit {
        let kind = match e.kind {
            "shutdown" => SHEAF_EXIT_SHUTDOWN,
            "reset" => SHEAF_EXIT_RESET,
            "debug_exit" => SHEAF_EXIT_DEBUG_EXIT,
            "crash" => SHEAF_EXIT_CRASH,
            "internal_error" => SHEAF_EXIT_INTERNAL_ERROR,
            "stopped" => SHEAF_EXIT_STOPPED,
            _ => SHEAF_EXIT_UNKNOWN,
        };
        let mut out = sheaf_exit {
            kind,
            code: e.code,
            clean: e.clean,
            detail: [0; 128],
        };
        for (d, s) in out
            .detail
            .iter_mut()
            .zip(e.detail.bytes().filter(|b| *b != 0).take(127))
        {
            *d = s as c_char;
        }
        out
    }
}

/// Creates a VM named `name` (NULL: `"sheaf-vm"`) with 1 vCPU, 128 MiB and
/// no kernel. Configure it, then `sheaf_vm_start`. Free with
/// `sheaf_vm_free`.
///
/// # Safety
/// `name` is NULL or a NUL-terminated string; `out` is valid for writing one
/// pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sheaf_vm_new(name: *const c_char, out: *mut *mut sheaf_vm) -> c_int {
    guard(|| {
        // SAFETY: `out` is writable per the contract.
        unsafe { out_arg(out, "out", std::ptr::null_mut()) }?;
        // SAFETY: `name` per the contract.
        let name = unsafe { opt_str_arg(name, "name") }?.unwrap_or("");
        let t = VMS.insert(VmHandle::new(name));
        // SAFETY: checked above.
        unsafe { put(out, to_ptr(t)) };
        Ok(())
    })
}

/// Creates a VM from a complete `VmConfig` JSON document (the serde form
/// in docs/vmm.md: `{"vcpus":1,"kernel":{"path":"..."},...}`); validated at
/// start.
///
/// # Safety
/// `config_json` is a NUL-terminated string; `out` is valid for writing one
/// pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sheaf_vm_new_from_json(
    config_json: *const c_char,
    out: *mut *mut sheaf_vm,
) -> c_int {
    guard(|| {
        // SAFETY: `out` is writable per the contract.
        unsafe { out_arg(out, "out", std::ptr::null_mut()) }?;
        // SAFETY: per the contract.
        let json = unsafe { str_arg(config_json, "config_json") }?;
        let t = VMS.insert(VmHandle::from_json(json)?);
        // SAFETY: checked above.
        unsafe { put(out, to_ptr(t)) };
        Ok(())
    })
}

/// Stops the VM if it runs and frees the handle. NULL gives `SHEAF_EBADF`
/// (so does a second free). A thread blocked in `sheaf_vm_wait` on this VM
/// returns.
#[unsafe(no_mangle)]
pub extern "C" fn sheaf_vm_free(vm: *mut sheaf_vm) -> c_int {
    guard(|| {
        let h = VMS.remove(to_token(vm))?;
        h.stop();
        Ok(())
    })
}

/// Sets the number of vCPUs (1–254). Only before start (else
/// `SHEAF_ESTATE`), like every `sheaf_vm_set_*` / `add` / `attach` call.
#[unsafe(no_mangle)]
pub extern "C" fn sheaf_vm_set_vcpus(vm: *mut sheaf_vm, vcpus: u32) -> c_int {
    guard(|| Ok(get_vm(vm)?.set_vcpus(vcpus)?))
}

/// Sets guest RAM in MiB (at least 16).
#[unsafe(no_mangle)]
pub extern "C" fn sheaf_vm_set_memory_mib(vm: *mut sheaf_vm, mib: u64) -> c_int {
    guard(|| Ok(get_vm(vm)?.set_memory_mib(mib)?))
}

/// Sets the kernel image: an ELF (vmlinux, the probe guest) or a bzImage.
///
/// # Safety
/// `path` is a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sheaf_vm_set_kernel(vm: *mut sheaf_vm, path: *const c_char) -> c_int {
    guard(|| {
        // SAFETY: per the contract.
        let p = unsafe { str_arg(path, "path") }?;
        Ok(get_vm(vm)?.set_kernel(p.into())?)
    })
}

/// Sets the initramfs; NULL removes it.
///
/// # Safety
/// `path` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sheaf_vm_set_initramfs(vm: *mut sheaf_vm, path: *const c_char) -> c_int {
    guard(|| {
        // SAFETY: per the contract.
        let p = unsafe { opt_str_arg(path, "path") }?;
        Ok(get_vm(vm)?.set_initramfs(p.map(Into::into))?)
    })
}

/// Sets the kernel command line.
///
/// # Safety
/// `cmdline` is a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sheaf_vm_set_cmdline(vm: *mut sheaf_vm, cmdline: *const c_char) -> c_int {
    guard(|| {
        // SAFETY: per the contract.
        let c = unsafe { str_arg(cmdline, "cmdline") }?;
        Ok(get_vm(vm)?.set_cmdline(c)?)
    })
}

/// Sets the boot protocol: `SHEAF_BOOT_LINUX64` or `SHEAF_BOOT_PVH`.
#[unsafe(no_mangle)]
pub extern "C" fn sheaf_vm_set_boot_protocol(vm: *mut sheaf_vm, protocol: u32) -> c_int {
    guard(|| {
        let p = match protocol {
            SHEAF_BOOT_LINUX64 => parse_boot_protocol("linux64")?,
            SHEAF_BOOT_PVH => parse_boot_protocol("pvh")?,
            other => return Err(FfiError::invalid(format!("boot protocol {other} unknown"))),
        };
        Ok(get_vm(vm)?.set_boot_protocol(p)?)
    })
}

/// Also describes each virtio-mmio device on the kernel command line
/// (`virtio_mmio.device=...`), for kernels without ACPI discovery and for
/// the probe guest.
#[unsafe(no_mangle)]
pub extern "C" fn sheaf_vm_set_cmdline_virtio_devices(vm: *mut sheaf_vm, on: bool) -> c_int {
    guard(|| Ok(get_vm(vm)?.set_cmdline_virtio_devices(on)?))
}

/// Adds a virtio-blk disk over a raw image file or block device (opened
/// now: a missing file gives `SHEAF_ENOENT`). Disks appear to the guest in
/// the order they are added (`/dev/vda`, `/dev/vdb`, ...).
///
/// # Safety
/// `path` is a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sheaf_vm_add_disk(
    vm: *mut sheaf_vm,
    path: *const c_char,
    read_only: bool,
) -> c_int {
    guard(|| {
        // SAFETY: per the contract.
        let p = unsafe { str_arg(path, "path") }?;
        Ok(get_vm(vm)?.add_disk(p.into(), read_only, None)?)
    })
}

/// Adds a virtio-blk disk served by a volume, with device id `id` (at most
/// 20 bytes; what the guest's `GET_ID` returns). The VM keeps the volume
/// attached: `sheaf_volume_close` may be called at any time, the volume
/// detaches once the VM is freed too.
///
/// # Safety
/// `id` is a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sheaf_vm_attach_volume(
    vm: *mut sheaf_vm,
    volume: *mut crate::volume::sheaf_volume,
    id: *const c_char,
) -> c_int {
    guard(|| {
        // SAFETY: per the contract.
        let id = unsafe { str_arg(id, "id") }?;
        let h = get_vm(vm)?;
        let v = VOLUMES.get(to_token(volume))?;
        Ok(h.attach_backend(v.backend(id)?)?)
    })
}

/// Builds the machine (first call) and starts it. Errors in the
/// configuration (missing kernel, bad memory size) are reported here, and
/// the VM stays configurable.
#[unsafe(no_mangle)]
pub extern "C" fn sheaf_vm_start(vm: *mut sheaf_vm) -> c_int {
    guard(|| Ok(get_vm(vm)?.start()?))
}

/// Pauses: returns once every vCPU has left the guest.
#[unsafe(no_mangle)]
pub extern "C" fn sheaf_vm_pause(vm: *mut sheaf_vm) -> c_int {
    guard(|| Ok(get_vm(vm)?.pause()?))
}

/// Resumes a paused VM.
#[unsafe(no_mangle)]
pub extern "C" fn sheaf_vm_resume(vm: *mut sheaf_vm) -> c_int {
    guard(|| Ok(get_vm(vm)?.resume()?))
}

/// Stops the VM and waits until it stopped; writes why to `exit` (NULL to
/// ignore). A VM never started just becomes stopped.
///
/// # Safety
/// `exit` is NULL or valid for writing one `sheaf_exit`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sheaf_vm_stop(vm: *mut sheaf_vm, exit: *mut sheaf_exit) -> c_int {
    guard(|| {
        let e = get_vm(vm)?.stop();
        // SAFETY: optional output per the contract.
        unsafe { put(exit, sheaf_exit::from(&e)) };
        Ok(())
    })
}

/// Waits until the VM stops, at most `timeout_ms` milliseconds (negative:
/// forever); writes why to `exit` (NULL to ignore). Returns
/// `SHEAF_ETIMEDOUT` if it still runs. Safe to call from another thread
/// than the one that pauses or stops the VM.
///
/// # Safety
/// `exit` is NULL or valid for writing one `sheaf_exit`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sheaf_vm_wait(
    vm: *mut sheaf_vm,
    timeout_ms: i64,
    exit: *mut sheaf_exit,
) -> c_int {
    guard(|| {
        // SAFETY: optional output per the contract.
        unsafe { put(exit, sheaf_exit::EMPTY) };
        let timeout = u64::try_from(timeout_ms).ok().map(Duration::from_millis);
        match get_vm(vm)?.wait(timeout)? {
            Some(e) => {
                // SAFETY: optional output per the contract.
                unsafe { put(exit, sheaf_exit::from(&e)) };
                Ok(())
            }
            None => Err(FfiError::new(
                SHEAF_ETIMEDOUT,
                format!("VM still running after {timeout_ms} ms"),
            )),
        }
    })
}

/// Writes the state (`SHEAF_VM_CREATED`, `_RUNNING`, `_PAUSED`,
/// `_STOPPED`) to `out`.
///
/// # Safety
/// `out` is valid for writing one `uint32_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sheaf_vm_state(vm: *mut sheaf_vm, out: *mut u32) -> c_int {
    guard(|| {
        // SAFETY: per the contract.
        unsafe { out_arg(out, "out", SHEAF_VM_CREATED) }?;
        let s = match get_vm(vm)?.state() {
            "running" => SHEAF_VM_RUNNING,
            "paused" => SHEAF_VM_PAUSED,
            "stopped" => SHEAF_VM_STOPPED,
            _ => SHEAF_VM_CREATED,
        };
        // SAFETY: checked above.
        unsafe { put(out, s) };
        Ok(())
    })
}

/// The console output still held (the last 64 KiB by default) as a
/// NUL-terminated string (invalid UTF-8 and NUL bytes replaced). Free it
/// with `sheaf_string_free`.
///
/// # Safety
/// `out` is valid for writing one pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sheaf_vm_console(vm: *mut sheaf_vm, out: *mut *mut c_char) -> c_int {
    guard(|| {
        // SAFETY: per the contract.
        unsafe { out_arg(out, "out", std::ptr::null_mut()) }?;
        let bytes = get_vm(vm)?.console();
        // SAFETY: checked above.
        unsafe { put_string(out, &String::from_utf8_lossy(&bytes)) };
        Ok(())
    })
}

/// Tails the console: copies output from absolute byte position `pos`
/// (0 = since boot; clamped to what is still held) into `buf`, at most
/// `cap` bytes; writes the count to `out_len` and the position to continue
/// from to `out_next` (`pos` of the next call).
///
/// # Safety
/// `buf` is valid for writing `cap` bytes (may be NULL if `cap` is 0);
/// `out_len` and `out_next` are valid for writing.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sheaf_vm_console_read(
    vm: *mut sheaf_vm,
    pos: u64,
    buf: *mut u8,
    cap: usize,
    out_len: *mut usize,
    out_next: *mut u64,
) -> c_int {
    guard(|| {
        // SAFETY: per the contract.
        unsafe { out_arg(out_len, "out_len", 0) }?;
        // SAFETY: per the contract.
        unsafe { out_arg(out_next, "out_next", pos) }?;
        // SAFETY: per the contract.
        let buf = unsafe { bytes_mut_arg(buf, cap, "buf") }?;
        let (data, end) = get_vm(vm)?.console_read(pos);
        let start = end - data.len() as u64;
        let n = data.len().min(buf.len());
        buf[..n].copy_from_slice(&data[..n]);
        // SAFETY: both checked above.
        unsafe {
            put(out_len, n);
            put(out_next, start + n as u64);
        }
        Ok(())
    })
}

/// Types `len` bytes into the guest's serial port; writes the number
/// accepted (the input queue is bounded) to `out_accepted` (NULL to
/// ignore). The VM must have been started.
///
/// # Safety
/// `data` is valid for reading `len` bytes; `out_accepted` is NULL or
/// valid for writing.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sheaf_vm_serial_input(
    vm: *mut sheaf_vm,
    data: *const u8,
    len: usize,
    out_accepted: *mut usize,
) -> c_int {
    guard(|| {
        // SAFETY: per the contract.
        let d = unsafe { bytes_arg(data, len, "data") }?;
        let n = get_vm(vm)?.serial_input(d)?;
        // SAFETY: optional output per the contract.
        unsafe { put(out_accepted, n) };
        Ok(())
    })
}

/// Counters and timings as JSON (`pio_exits`, `mmio_exits`,
/// `block_requests`, `block_errors`, `start_to_first_exit_us`, ...). Free
/// with `sheaf_string_free`.
///
/// # Safety
/// `out` is valid for writing one pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sheaf_vm_metrics_json(vm: *mut sheaf_vm, out: *mut *mut c_char) -> c_int {
    guard(|| {
        // SAFETY: per the contract.
        unsafe { out_arg(out, "out", std::ptr::null_mut()) }?;
        let m = get_vm(vm)?.metrics();
        let s =
            serde_json::to_string(&m).map_err(|e| FfiError::invalid(format!("metrics: {e}")))?;
        // SAFETY: checked above.
        unsafe { put_string(out, &s) };
        Ok(())
    })
}

/// The VM's configuration as `VmConfig` JSON. Free with
/// `sheaf_string_free`.
///
/// # Safety
/// `out` is valid for writing one pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sheaf_vm_config_json(vm: *mut sheaf_vm, out: *mut *mut c_char) -> c_int {
    guard(|| {
        // SAFETY: per the contract.
        unsafe { out_arg(out, "out", std::ptr::null_mut()) }?;
        let s = get_vm(vm)?.config_json()?;
        // SAFETY: checked above.
        unsafe { put_string(out, &s) };
        Ok(())
    })
}

/// Path of the probe guest: a tiny x86_64 test kernel built with sheaf
/// that checks its boot, echoes `probe.token=` from its command line,
/// drives a virtio-blk disk and exits through port 0xf4 (see docs/vmm.md).
/// `SHEAF_PROBE_ELF` in the environment overrides it. A static string.
#[unsafe(no_mangle)]
pub extern "C" fn sheaf_probe_guest_path() -> *const c_char {
    static P: OnceLock<std::ffi::CString> = OnceLock::new();
    guard_value(std::ptr::null(), || {
        P.get_or_init(|| {
            std::ffi::CString::new(probe_guest_path().to_string_lossy().into_owned())
                .unwrap_or_default()
        })
        .as_ptr()
    })
}
