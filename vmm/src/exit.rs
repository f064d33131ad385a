// SPDX-License-Identifier: Apache-2.0
//! Why a VM stopped, and the one-shot latch devices and vCPUs use to say so.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use vmm_sys_util::eventfd::EventFd;

/// Why the guest stopped running.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "reason")]
#[non_exhaustive]
pub enum ExitReason {
    /// The guest powered off (ACPI S5, e.g. `poweroff`).
    Shutdown,
    /// The guest asked for a reset: ACPI reset register, i8042 `0xfe`, or a
    /// triple fault. The VMM does not reboot by itself; the owner decides.
    Reset,
    /// The guest wrote `code` to the debug-exit port.
    DebugExit {
        /// The value written.
        code: u32,
    },
    /// The guest put a vCPU in a state it cannot leave (for example an
    /// entry failure or an unhandled exception during boot).
    Crash {
        /// The vCPU that failed.
        vcpu: u8,
        /// What KVM reported.
        detail: String,
    },
    /// The VMM itself failed (a device or KVM ioctl error).
    InternalError {
        /// What failed.
        detail: String,
    },
    /// The host stopped the VM through [`crate::Vm::stop`].
    Stopped,
}

impl ExitReason {
    /// True for a guest-initiated clean power-off or a debug exit with code 0.
    pub fn is_clean(&self) -> bool {
        matches!(
            self,
            ExitReason::Shutdown | ExitReason::DebugExit { code: 0 }
        )
    }
}

/// The first exit reason wins; later ones are ignored. Requesting an exit
/// wakes the VM's control loop through an eventfd.
#[derive(Debug, Clone)]
pub struct ExitLatch {
    inner: Arc<ExitInner>,
}

#[derive(Debug)]
struct ExitInner {
    reason: Mutex<Option<ExitReason>>,
    exiting: AtomicBool,
    evt: EventFd,
}

impl ExitLatch {
    /// A new, untriggered latch.
    pub fn new() -> std::io::Result<Self> {
        Ok(ExitLatch {
            inner: Arc::new(ExitInner {
                reason: Mutex::new(None),
                exiting: AtomicBool::new(false),
                evt: EventFd::new(libc::EFD_NONBLOCK)?,
            }),
        })
    }

    /// Records `reason` if no reason was recorded yet, and wakes the control loop.
    pub fn request(&self, reason: ExitReason) {
        let mut r = self.inner.reason.lock().unwrap_or_else(|p| p.into_inner());
        if r.is_none() {
            tracing::debug!(?reason, "guest exit requested");
            *r = Some(reason);
            self.inner.exiting.store(true, Ordering::SeqCst);
            let _ = self.inner.evt.write(1);
        }
    }

    /// True once any exit was requested.
    pub fn is_set(&self) -> bool {
        self.inner.exiting.load(Ordering::SeqCst)
    }

    /// The recorded reason.
    pub fn reason(&self) -> Option<ExitReason> {
        self.inner
            .reason
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The eventfd signalled on the first request.
    pub fn eventfd(&self) -> &EventFd {
        &self.inner.evt
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_reason_wins() {
        let l = ExitLatch::new().unwrap();
        assert!(!l.is_set());
        l.request(ExitReason::DebugExit { code: 3 });
        l.request(ExitReason::Shutdown);
        assert!(l.is_set());
        assert_eq!(l.reason(), Some(ExitReason::DebugExit { code: 3 }));
        assert_eq!(l.eventfd().read().unwrap(), 1);
        assert!(ExitReason::Shutdown.is_clean());
        assert!(!ExitReason::DebugExit { code: 1 }.is_clean());
    }
}
