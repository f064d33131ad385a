// SPDX-License-Identifier: Apache-2.0
//! Checked conversions of C arguments, and library-owned strings.
//!
//! Every pointer argument is checked for NULL before use; the remaining
//! contracts (a string is NUL-terminated, a buffer is valid for `len`
//! bytes) are the caller's and are written in the header.

use std::collections::BTreeSet;
use std::ffi::{CStr, CString, c_char};
use std::sync::Mutex;

use crate::error::{FfiError, FfiResult};

/// Strings handed to C and not yet freed, so `sheaf_string_free` rejects
/// pointers it did not hand out (or already freed) instead of corrupting
/// the heap.
static STRINGS: Mutex<BTreeSet<usize>> = Mutex::new(BTreeSet::new());

/// A required UTF-8 string argument.
///
/// # Safety
/// `p` is NULL or points to a NUL-terminated string valid for reads for the
/// duration of the call.
pub(crate) unsafe fn str_arg<'a>(p: *const c_char, name: &str) -> FfiResult<&'a str> {
    if p.is_null() {
        return Err(FfiError::invalid(format!("{name} is NULL")));
    }
    // SAFETY: non-NULL and NUL-terminated per this function's contract.
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str()
        .map_err(|e| FfiError::invalid(format!("{name} is not UTF-8: {e}")))
}

/// An optional UTF-8 string argument (NULL means absent).
///
/// # Safety
/// As [`str_arg`].
pub(crate) unsafe fn opt_str_arg<'a>(p: *const c_char, name: &str) -> FfiResult<Option<&'a str>> {
    if p.is_null() {
        Ok(None)
    } else {
        // SAFETY: forwarded contract.
        unsafe { str_arg(p, name) }.map(Some)
    }
}

/// A byte buffer argument; `len == 0` accepts NULL.
///
/// # Safety
/// `p` is NULL or valid for reads of `len` bytes for the duration of the
/// call.
pub(crate) unsafe fn bytes_arg<'a>(p: *const u8, len: usize, name: &str) -> FfiResult<&'a [u8]> {
    if len == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(FfiError::invalid(format!("{name} is NULL")));
    }
    // SAFETY: non-NULL and valid for `len` bytes per the contract.
    Ok(unsafe { std::slice::from_raw_parts(p, len) })
}

/// A writable byte buffer argument; `len == 0` accepts NULL.
///
/// # Safety
/// `p` is NULL or valid for writes of `len` bytes, not aliased, for the
/// duration of the call.
pub(crate) unsafe fn bytes_mut_arg<'a>(
    p: *mut u8,
    len: usize,
    name: &str,
) -> FfiResult<&'a mut [u8]> {
    if len == 0 {
        return Ok(&mut []);
    }
    if p.is_null() {
        return Err(FfiError::invalid(format!("{name} is NULL")));
    }
    // SAFETY: non-NULL, valid for `len` writable bytes, unaliased per the
    // contract.
    Ok(unsafe { std::slice::from_raw_parts_mut(p, len) })
}

/// Checks a required out-pointer and clears what it points to.
///
/// # Safety
/// `out` is NULL or valid for writes of one `T`.
pub(crate) unsafe fn out_arg<T>(out: *mut T, name: &str, empty: T) -> FfiResult<()> {
    if out.is_null() {
        return Err(FfiError::invalid(format!("{name} is NULL")));
    }
    // SAFETY: non-NULL and writable per the contract.
    unsafe { out.write(empty) };
    Ok(())
}

/// Writes `v` through an out-pointer already checked by [`out_arg`] (or
/// skips it when the pointer is NULL for an optional output).
///
/// # Safety
/// `out` is NULL or valid for writes of one `T`.
pub(crate) unsafe fn put<T>(out: *mut T, v: T) {
    if !out.is_null() {
        // SAFETY: non-NULL and writable per the contract.
        unsafe { out.write(v) };
    }
}

/// A library-owned copy of `s` for C (NULs become U+FFFD).
pub(crate) fn new_string(s: &str) -> *mut c_char {
    let c = match CString::new(s) {
        Ok(c) => c,
        Err(_) => CString::new(s.replace('\0', "\u{fffd}"))
            .unwrap_or_else(|_| unreachable!("no NUL left after replacing every NUL")),
    };
    let p = c.into_raw();
    STRINGS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(p.addr());
    p
}

/// Strings handed out and not yet freed.
pub(crate) fn live_strings() -> usize {
    STRINGS.lock().unwrap_or_else(|e| e.into_inner()).len()
}

/// Frees a string from [`new_string`]; NULL is a no-op.
pub(crate) fn free_string(p: *mut c_char) -> FfiResult<()> {
    if p.is_null() {
        return Ok(());
    }
    let known = STRINGS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&p.addr());
    if !known {
        return Err(FfiError::invalid(format!(
            "{p:p} is not a string returned by sheaf (or it was already freed)"
        )));
    }
    // SAFETY: `p` came from CString::into_raw in new_string and was still
    // registered, so it is live and freed exactly once (we just removed it).
    drop(unsafe { CString::from_raw(p) });
    Ok(())
}

/// Writes a library-owned string through a checked `char **` out-pointer.
///
/// # Safety
/// `out` was checked by [`out_arg`] (non-NULL, writable).
pub(crate) unsafe fn put_string(out: *mut *mut c_char, s: &str) {
    // SAFETY: forwarded contract.
    unsafe { put(out, new_string(s)) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strings_are_tracked() {
        let p = new_string("a\0b");
        // SAFETY: p is a live CString from new_string.
        let s = unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned();
        assert_eq!(s, "a\u{fffd}b");
        free_string(p).expect("free");
        assert!(free_string(p).is_err(), "double free is refused");
        let mut local = [0 as c_char; 4];
        assert!(free_string(local.as_mut_ptr()).is_err(), "foreign pointer");
        free_string(std::ptr::null_mut()).expect("NULL is a no-op");
    }
}
