// SPDX-License-Identifier: Apache-2.0
//! Status codes, the thread-local last error, and the guard every exported
//! function runs its body in (no panic crosses the C boundary).

use std::any::Any;
use std::cell::RefCell;
use std::ffi::{CString, c_char, c_int};
use std::panic::{AssertUnwindSafe, catch_unwind};

use sheaf_bindings_core::{Error, ErrorKind};

/// Success.
pub const SHEAF_OK: c_int = 0;
/// No such object: a file, a cluster object, a node (`-ENOENT`).
pub const SHEAF_ENOENT: c_int = -2;
/// A host I/O error (`-EIO`).
pub const SHEAF_EIO: c_int = -5;
/// A bad handle: NULL, already freed, or of another type (`-EBADF`).
pub const SHEAF_EBADF: c_int = -9;
/// Permission denied, e.g. a token refused with HTTP 401/403 (`-EACCES`).
pub const SHEAF_EACCES: c_int = -13;
/// The object is in the wrong state for the call, e.g. configuring a
/// running VM (`-EBUSY`).
pub const SHEAF_ESTATE: c_int = -16;
/// An invalid argument: a NULL pointer, bad UTF-8, a value out of range,
/// malformed JSON (`-EINVAL`).
pub const SHEAF_EINVAL: c_int = -22;
/// A buffer is too small (`-ERANGE`).
pub const SHEAF_ERANGE: c_int = -34;
/// The call timed out (`-ETIMEDOUT`).
pub const SHEAF_ETIMEDOUT: c_int = -110;
/// The VMM failed (KVM, guest image, devices).
pub const SHEAF_EVMM: c_int = -1001;
/// The replicated volume failed (quorum lost, fenced, replicas down).
pub const SHEAF_EVOLUME: c_int = -1002;
/// No node can take the request; the message is kube-scheduler's.
pub const SHEAF_EUNSCHEDULABLE: c_int = -1003;
/// Another scheduler failure (unknown profile, plugin refusal, ...).
pub const SHEAF_ESCHED: c_int = -1004;
/// The cluster API failed or answered with an error status.
pub const SHEAF_ECLUSTER: c_int = -1005;
/// A bug inside sheaf was caught (a Rust panic); the handle involved may
/// be unusable, the process is intact.
pub const SHEAF_EPANIC: c_int = -1006;

/// An error on its way to C: a status code and a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FfiError {
    pub code: c_int,
    pub message: String,
}

pub(crate) type FfiResult<T> = Result<T, FfiError>;

impl FfiError {
    pub(crate) fn new(code: c_int, message: impl Into<String>) -> FfiError {
        FfiError {
            code,
            message: message.into(),
        }
    }

    pub(crate) fn invalid(message: impl Into<String>) -> FfiError {
        FfiError::new(SHEAF_EINVAL, message)
    }

    /// Stores the error as this thread's last error; returns its code.
    fn record(self) -> c_int {
        let msg = CString::new(self.message.replace('\0', "\\0"))
            .unwrap_or_else(|_| c"error message unavailable".to_owned());
        LAST.with(|l| *l.borrow_mut() = Some((self.code, msg)));
        self.code
    }
}

/// The status code for an error kind.
pub(crate) fn code_of(kind: ErrorKind) -> c_int {
    match kind {
        ErrorKind::InvalidArgument => SHEAF_EINVAL,
        ErrorKind::State => SHEAF_ESTATE,
        ErrorKind::Io => SHEAF_EIO,
        ErrorKind::Timeout => SHEAF_ETIMEDOUT,
        ErrorKind::NotFound => SHEAF_ENOENT,
        ErrorKind::PermissionDenied => SHEAF_EACCES,
        ErrorKind::Vmm => SHEAF_EVMM,
        ErrorKind::Volume => SHEAF_EVOLUME,
        ErrorKind::Unschedulable => SHEAF_EUNSCHEDULABLE,
        ErrorKind::Sched => SHEAF_ESCHED,
        ErrorKind::Cluster => SHEAF_ECLUSTER,
        // A kind added later than this binding: the generic VMM-less code.
        _ => SHEAF_EIO,
    }
}

impl From<Error> for FfiError {
    fn from(e: Error) -> FfiError {
        FfiError::new(code_of(e.kind()), e.report())
    }
}

thread_local! {
    static LAST: RefCell<Option<(c_int, CString)>> = const { RefCell::new(None) };
}

fn panic_message(p: &(dyn Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic payload".into()
    }
}

/// Runs an exported function's body: panics become `SHEAF_EPANIC`, errors
/// become their code with the message stored for `sheaf_last_error()`.
pub(crate) fn guard(f: impl FnOnce() -> FfiResult<()>) -> c_int {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => SHEAF_OK,
        Ok(Err(e)) => e.record(),
        Err(payload) => {
            let msg = panic_message(&*payload);
            // Dropping a payload can itself panic; never let that escape.
            let _ = catch_unwind(AssertUnwindSafe(move || drop(payload)));
            tracing::error!(panic = %msg, "panic caught at the C boundary");
            FfiError::new(
                SHEAF_EPANIC,
                format!("internal error: a panic was caught at the C boundary: {msg}"),
            )
            .record()
        }
    }
}

/// Like [`guard`] for functions that return a value instead of a status;
/// a panic gives `fallback`.
pub(crate) fn guard_value<T>(fallback: T, f: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or(fallback)
}

/// The message of the most recent failed call on this thread.
pub(crate) fn last_error_ptr() -> *const c_char {
    LAST.with(|l| match &*l.borrow() {
        // The CString lives in the thread-local until the next failure on
        // this thread or sheaf_clear_error(), as the header documents.
        Some((_, s)) => s.as_ptr(),
        None => std::ptr::null(),
    })
}

/// The code of the most recent failed call on this thread (0 if none).
pub(crate) fn last_error_code() -> c_int {
    LAST.with(|l| l.borrow().as_ref().map_or(SHEAF_OK, |(c, _)| *c))
}

/// Forgets this thread's last error.
pub(crate) fn clear_last_error() {
    LAST.with(|l| *l.borrow_mut() = None);
}

/// The constant's name for a status code.
pub(crate) fn status_name(code: c_int) -> &'static std::ffi::CStr {
    match code {
        SHEAF_OK => c"SHEAF_OK",
        SHEAF_ENOENT => c"SHEAF_ENOENT",
        SHEAF_EIO => c"SHEAF_EIO",
        SHEAF_EBADF => c"SHEAF_EBADF",
        SHEAF_EACCES => c"SHEAF_EACCES",
        SHEAF_ESTATE => c"SHEAF_ESTATE",
        SHEAF_EINVAL => c"SHEAF_EINVAL",
        SHEAF_ERANGE => c"SHEAF_ERANGE",
        SHEAF_ETIMEDOUT => c"SHEAF_ETIMEDOUT",
        SHEAF_EVMM => c"SHEAF_EVMM",
        SHEAF_EVOLUME => c"SHEAF_EVOLUME",
        SHEAF_EUNSCHEDULABLE => c"SHEAF_EUNSCHEDULABLE",
        SHEAF_ESCHED => c"SHEAF_ESCHED",
        SHEAF_ECLUSTER => c"SHEAF_ECLUSTER",
        SHEAF_EPANIC => c"SHEAF_EPANIC",
        _ => c"SHEAF_UNKNOWN",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guard_records_errors_and_catches_panics() {
        clear_last_error();
        assert_eq!(guard(|| Ok(())), SHEAF_OK);
        assert_eq!(last_error_code(), SHEAF_OK);
        assert!(last_error_ptr().is_null());
        assert_eq!(guard(|| Err(FfiError::invalid("bad\0thing"))), SHEAF_EINVAL);
        assert_eq!(last_error_code(), SHEAF_EINVAL);
        #[allow(clippy::panic)]
        let code = guard(|| panic!("boom {}", 42));
        assert_eq!(code, SHEAF_EPANIC);
        // SAFETY: last_error_ptr returned a live thread-local CString.
        let msg = unsafe { std::ffi::CStr::from_ptr(last_error_ptr()) };
        assert!(msg.to_string_lossy().contains("boom 42"), "{msg:?}");
        // A success leaves the last error alone (errno-like).
        assert_eq!(guard(|| Ok(())), SHEAF_OK);
        assert_eq!(last_error_code(), SHEAF_EPANIC);
        assert_eq!(status_name(SHEAF_EUNSCHEDULABLE), c"SHEAF_EUNSCHEDULABLE");
    }
}
