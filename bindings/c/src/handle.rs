// SPDX-License-Identifier: Apache-2.0
//! Handle registries: a C handle is an opaque pointer whose *value* is a
//! token, never an address. The library never dereferences it; it looks
//! the token up in the registry of its type.
//!
//! ```text
//!   token = serial << 4 | kind        serial: process-wide, never reused
//! ```
//!
//! So NULL, a freed handle (double free, use after free), a handle of
//! another type or a made-up pointer are all just "not found" and give
//! `SHEAF_EBADF`, never undefined behaviour. Each registry is a
//! reader-writer lock held only for the lookup; the object itself is an
//! `Arc` with its own lock, so calls on different handles never serialize
//! and a slow call (a VM `wait`) never blocks calls on other handles.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use crate::error::{FfiError, FfiResult, SHEAF_EBADF};

const KIND_BITS: u32 = 4;
const KIND_MASK: u64 = (1 << KIND_BITS) - 1;

static NEXT_SERIAL: AtomicU64 = AtomicU64::new(1);

/// The objects of one handle type.
pub(crate) struct Registry<T> {
    kind: u64,
    name: &'static str,
    map: RwLock<BTreeMap<u64, Arc<T>>>,
}

impl<T> Registry<T> {
    pub(crate) const fn new(kind: u64, name: &'static str) -> Registry<T> {
        Registry {
            kind,
            name,
            map: RwLock::new(BTreeMap::new()),
        }
    }

    /// Registers `v`; returns its token (never 0).
    pub(crate) fn insert(&self, v: T) -> usize {
        let serial = NEXT_SERIAL.fetch_add(1, Ordering::Relaxed);
        let token = (serial << KIND_BITS) | self.kind;
        self.map
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(token, Arc::new(v));
        // Tokens fit in a pointer on the 64-bit targets sheaf supports.
        token as usize
    }

    fn check(&self, token: usize) -> FfiResult<u64> {
        let t = token as u64;
        if t == 0 {
            return Err(FfiError::new(
                SHEAF_EBADF,
                format!("{} handle is NULL", self.name),
            ));
        }
        if t & KIND_MASK != self.kind {
            return Err(FfiError::new(
                SHEAF_EBADF,
                format!("{token:#x} is not a {} handle", self.name),
            ));
        }
        Ok(t)
    }

    fn stale(&self, token: usize) -> FfiError {
        FfiError::new(
            SHEAF_EBADF,
            format!(
                "{} handle {token:#x} is not live (already freed, or never returned by sheaf)",
                self.name
            ),
        )
    }

    /// The object behind a live handle.
    pub(crate) fn get(&self, token: usize) -> FfiResult<Arc<T>> {
        let t = self.check(token)?;
        self.map
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&t)
            .cloned()
            .ok_or_else(|| self.stale(token))
    }

    /// Unregisters a handle; the object lives on while other calls still
    /// hold it.
    pub(crate) fn remove(&self, token: usize) -> FfiResult<Arc<T>> {
        let t = self.check(token)?;
        self.map
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&t)
            .ok_or_else(|| self.stale(token))
    }

    /// Live handles of this type.
    pub(crate) fn len(&self) -> usize {
        self.map.read().unwrap_or_else(|p| p.into_inner()).len()
    }
}

/// Handle token → opaque pointer (never dereferenced).
pub(crate) fn to_ptr<H>(token: usize) -> *mut H {
    std::ptr::without_provenance_mut(token)
}

/// Opaque pointer → handle token.
pub(crate) fn to_token<H>(p: *const H) -> usize {
    p.addr()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn misuse_is_detected() {
        static A: Registry<String> = Registry::new(1, "alpha");
        static B: Registry<String> = Registry::new(2, "beta");
        let a = A.insert("a".into());
        let b = B.insert("b".into());
        assert_eq!(*A.get(a).expect("live"), "a");
        assert_eq!(A.get(0).expect_err("null").code, SHEAF_EBADF);
        assert!(
            A.get(b)
                .expect_err("wrong kind")
                .message
                .contains("not a alpha")
        );
        assert!(A.get(a + 16).is_err(), "made-up token");
        let held = A.get(a).expect("live");
        A.remove(a).expect("free");
        assert!(
            A.remove(a)
                .expect_err("double free")
                .message
                .contains("not live")
        );
        assert!(A.get(a).is_err(), "use after free");
        assert_eq!(*held, "a", "a caller inside a call keeps the object");
        assert_eq!(A.len(), 0);
        let a2 = A.insert("again".into());
        assert_ne!(a2, a, "tokens are never reused");
    }
}
