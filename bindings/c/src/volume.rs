// SPDX-License-Identifier: Apache-2.0
//! `sheaf_volume` (replicated block storage) and `sheaf_replica_server`.

use std::ffi::{c_char, c_int};
use std::time::Duration;

use sheaf_bindings_core::volume::{
    OpenOptions, ReplicaServer, VolumeHandle, create_replica, parse_replica,
};

use crate::args::{bytes_arg, bytes_mut_arg, out_arg, put, put_string, str_arg};
use crate::error::{FfiError, FfiResult, guard};
use crate::handle::{Registry, to_ptr, to_token};

/// An attached volume (opaque).
#[derive(Debug)]
pub struct sheaf_volume {
    _opaque: [u8; 0],
}

/// A replica server running in this process (opaque).
#[derive(Debug)]
pub struct sheaf_replica_server {
    _opaque: [u8; 0],
}

pub(crate) static VOLUMES: Registry<VolumeHandle> = Registry::new(2, "sheaf_volume");
pub(crate) static SERVERS: Registry<ReplicaServer> = Registry::new(3, "sheaf_replica_server");

fn volume(h: *const sheaf_volume) -> FfiResult<std::sync::Arc<VolumeHandle>> {
    VOLUMES.get(to_token(h))
}

/// Options for `sheaf_volume_open`. Zero-initialise it
/// (`sheaf_volume_options o = {0};`) and set what you need.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct sheaf_volume_options {
    /// Replication secret shared with the replica servers (at least 16
    /// bytes); NULL when every replica is local.
    pub secret: *const u8,
    /// Length of `secret`.
    pub secret_len: usize,
    /// Replicas that must hold a write before it completes; 0: `min(2, N)`.
    pub min_write_replicas: u32,
    /// Longest wait for enough replicas at open, in ms; 0: 10 s.
    pub attach_timeout_ms: u32,
}

/// Creates the store of one replica of a new volume at directory `path`
/// (any store there is replaced): `size_bytes` must be a positive multiple
/// of 4096. Create every replica of a new volume this way (or start
/// replica servers with `create_size`), then `sheaf_volume_open`.
///
/// # Safety
/// `path` is a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sheaf_volume_create(path: *const c_char, size_bytes: u64) -> c_int {
    guard(|| {
        // SAFETY: per the contract.
        let p = unsafe { str_arg(path, "path") }?;
        Ok(create_replica(p.as_ref(), size_bytes)?)
    })
}

/// Opens (attaches) a volume with one local replica at `path`.
///
/// # Safety
/// `path` is a NUL-terminated string; `out` is valid for writing one
/// pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sheaf_volume_open_local(
    path: *const c_char,
    out: *mut *mut sheaf_volume,
) -> c_int {
    guard(|| {
        // SAFETY: per the contract.
        unsafe { out_arg(out, "out", std::ptr::null_mut()) }?;
        // SAFETY: per the contract.
        let p = unsafe { str_arg(path, "path") }?;
        let v = VolumeHandle::open_local(p.as_ref())?;
        // SAFETY: checked above.
        unsafe { put(out, to_ptr(VOLUMES.insert(v))) };
        Ok(())
    })
}

/// Opens (attaches) a volume over `n` replicas, each either a local store
/// directory or `"tcp://HOST:PORT"` of a replica server (`sheaf-replica`
/// or `sheaf_replica_server_start`). The order is the replica identity:
/// keep it across opens. Waits until the volume serves I/O: it takes a new
/// epoch (fencing any previous opener) and rebuilds stale replicas in the
/// background. `options` may be NULL for defaults.
///
/// # Safety
/// `replicas` points to `n` NUL-terminated strings; `options` is NULL or
/// points to a `sheaf_volume_options` whose `secret` is valid for
/// `secret_len` bytes; `out` is valid for writing one pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sheaf_volume_open(
    replicas: *const *const c_char,
    n: usize,
    options: *const sheaf_volume_options,
    out: *mut *mut sheaf_volume,
) -> c_int {
    guard(|| {
        // SAFETY: per the contract.
        unsafe { out_arg(out, "out", std::ptr::null_mut()) }?;
        if n == 0 || replicas.is_null() {
            return Err(FfiError::invalid("a volume needs at least one replica"));
        }
        if n > 64 {
            return Err(FfiError::invalid(format!("{n} replicas is more than 64")));
        }
        // SAFETY: `replicas` points to `n` pointers per the contract.
        let list = unsafe { std::slice::from_raw_parts(replicas, n) };
        let mut targets = Vec::with_capacity(n);
        for (i, p) in list.iter().enumerate() {
            // SAFETY: each entry is a NUL-terminated string per the contract.
            let s = unsafe { str_arg(*p, &format!("replicas[{i}]")) }?;
            targets.push(parse_replica(s)?);
        }
        let mut opts = OpenOptions::default();
        if !options.is_null() {
            // SAFETY: non-NULL and pointing to an options struct per the
            // contract.
            let o = unsafe { &*options };
            if !o.secret.is_null() || o.secret_len != 0 {
                // SAFETY: `secret` is valid for `secret_len` bytes per the
                // contract.
                opts.secret =
                    Some(unsafe { bytes_arg(o.secret, o.secret_len, "secret") }?.to_vec());
            }
            if o.min_write_replicas != 0 {
                opts.min_write_replicas = Some(o.min_write_replicas as usize);
            }
            if o.attach_timeout_ms != 0 {
                opts.attach_timeout = Some(Duration::from_millis(u64::from(o.attach_timeout_ms)));
            }
        }
        let v = VolumeHandle::open(&targets, &opts)?;
        // SAFETY: checked above.
        unsafe { put(out, to_ptr(VOLUMES.insert(v))) };
        Ok(())
    })
}

/// Writes the volume size in bytes to `out`.
///
/// # Safety
/// `out` is valid for writing one `uint64_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sheaf_volume_size(vol: *mut sheaf_volume, out: *mut u64) -> c_int {
    guard(|| {
        // SAFETY: per the contract.
        unsafe { out_arg(out, "out", 0) }?;
        let s = volume(vol)?.size();
        // SAFETY: checked above.
        unsafe { put(out, s) };
        Ok(())
    })
}

/// Reads `len` bytes at byte `offset` into `buf` (any alignment). Blocks;
/// do not call from a thread of an async runtime that serves the volume.
///
/// # Safety
/// `buf` is valid for writing `len` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sheaf_volume_read(
    vol: *mut sheaf_volume,
    offset: u64,
    buf: *mut u8,
    len: usize,
) -> c_int {
    guard(|| {
        // SAFETY: per the contract.
        let b = unsafe { bytes_mut_arg(buf, len, "buf") }?;
        Ok(volume(vol)?.read_into(offset, b)?)
    })
}

/// Writes `len` bytes from `buf` at byte `offset` (any alignment; partial
/// 4 KiB blocks are read-modify-written). Returns once every in-sync
/// replica has the write; durable after `sheaf_volume_flush`.
///
/// # Safety
/// `buf` is valid for reading `len` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sheaf_volume_write(
    vol: *mut sheaf_volume,
    offset: u64,
    buf: *const u8,
    len: usize,
) -> c_int {
    guard(|| {
        // SAFETY: per the contract.
        let b = unsafe { bytes_arg(buf, len, "buf") }?;
        Ok(volume(vol)?.write(offset, b)?)
    })
}

/// Makes completed writes durable on every in-sync replica.
#[unsafe(no_mangle)]
pub extern "C" fn sheaf_volume_flush(vol: *mut sheaf_volume) -> c_int {
    guard(|| Ok(volume(vol)?.flush()?))
}

/// Waits up to `timeout_ms` until every replica is in sync (opening
/// returns once a write quorum is; the others catch up by a background
/// rebuild). `SHEAF_ETIMEDOUT` if they do not.
#[unsafe(no_mangle)]
pub extern "C" fn sheaf_volume_wait_in_sync(vol: *mut sheaf_volume, timeout_ms: u32) -> c_int {
    guard(|| {
        volume(vol)?.wait_in_sync(Duration::from_millis(u64::from(timeout_ms)))?;
        Ok(())
    })
}

/// The engine status as JSON: `phase`, `epoch`, `size_bytes`, `replicas`,
/// `active` and `rebuilding` (replica indexes), `rebuilds_done`,
/// `repairs`. Free with `sheaf_string_free`.
///
/// # Safety
/// `out` is valid for writing one pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sheaf_volume_status_json(
    vol: *mut sheaf_volume,
    out: *mut *mut c_char,
) -> c_int {
    guard(|| {
        // SAFETY: per the contract.
        unsafe { out_arg(out, "out", std::ptr::null_mut()) }?;
        let st = volume(vol)?.status()?;
        let s =
            serde_json::to_string(&st).map_err(|e| FfiError::invalid(format!("status: {e}")))?;
        // SAFETY: checked above.
        unsafe { put_string(out, &s) };
        Ok(())
    })
}

/// Flushes and frees the handle. The volume detaches once no VM uses it
/// either. A flush error is returned (the handle is freed anyway).
#[unsafe(no_mangle)]
pub extern "C" fn sheaf_volume_close(vol: *mut sheaf_volume) -> c_int {
    guard(|| {
        let v = VOLUMES.remove(to_token(vol))?;
        let v = std::sync::Arc::unwrap_or_clone(v);
        Ok(v.close()?)
    })
}

/// Serves the replica store in directory `dir` over authenticated TCP on
/// `listen` (`"127.0.0.1:0"`: any free port; see
/// `sheaf_replica_server_location`), like the `sheaf-replica` binary. With
/// `create_size` > 0 a store of that size is created first if `dir` has
/// none. `secret` (at least 16 bytes) must match the openers'.
///
/// # Safety
/// `dir` and `listen` are NUL-terminated strings; `secret` is valid for
/// `secret_len` bytes; `out` is valid for writing one pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sheaf_replica_server_start(
    dir: *const c_char,
    listen: *const c_char,
    secret: *const u8,
    secret_len: usize,
    create_size: u64,
    out: *mut *mut sheaf_replica_server,
) -> c_int {
    guard(|| {
        // SAFETY: per the contract.
        unsafe { out_arg(out, "out", std::ptr::null_mut()) }?;
        // SAFETY: per the contract.
        let dir = unsafe { str_arg(dir, "dir") }?;
        // SAFETY: per the contract.
        let listen = unsafe { str_arg(listen, "listen") }?;
        // SAFETY: per the contract.
        let secret = unsafe { bytes_arg(secret, secret_len, "secret") }?;
        let size = (create_size > 0).then_some(create_size);
        let s = ReplicaServer::start(dir.as_ref(), listen, secret, size)?;
        // SAFETY: checked above.
        unsafe { put(out, to_ptr(SERVERS.insert(s))) };
        Ok(())
    })
}

/// The server's location for `sheaf_volume_open`, `"tcp://IP:PORT"`. Free
/// with `sheaf_string_free`.
///
/// # Safety
/// `out` is valid for writing one pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sheaf_replica_server_location(
    server: *mut sheaf_replica_server,
    out: *mut *mut c_char,
) -> c_int {
    guard(|| {
        // SAFETY: per the contract.
        unsafe { out_arg(out, "out", std::ptr::null_mut()) }?;
        let loc = SERVERS.get(to_token(server))?.location();
        // SAFETY: checked above.
        unsafe { put_string(out, &loc) };
        Ok(())
    })
}

/// Stops the server (closing its connections) and frees the handle.
#[unsafe(no_mangle)]
pub extern "C" fn sheaf_replica_server_stop(server: *mut sheaf_replica_server) -> c_int {
    guard(|| {
        drop(SERVERS.remove(to_token(server))?);
        Ok(())
    })
}
