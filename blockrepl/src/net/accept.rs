//! Accept loops that survive a hostile or simply busy world.
//!
//! `accept(2)` fails for reasons that say nothing about the listener:
//! a client that reset before it was accepted (`ECONNABORTED`, `EPROTO`),
//! or a process or system out of descriptors or memory (`EMFILE`,
//! `ENFILE`, `ENOBUFS`, `ENOMEM`) — the last a client can cause on purpose
//! by opening connections. A server that returns on the first such error
//! stops serving everyone. [`AcceptBackoff`] tells the loop what to do:
//! try again at once, wait (growing from 5 ms to 1 s while the error
//! persists, so a level-triggered listener does not spin), or give up
//! because the listener itself is broken.

use std::io;
use std::time::Duration;

/// What an accept loop does after an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AcceptAction {
    /// The error concerned one connection: accept the next one now.
    Retry,
    /// Out of a resource: wait this long, then accept again.
    Wait(Duration),
    /// The listener is unusable: stop.
    Fatal,
}

/// Back-off state of one accept loop.
#[derive(Debug, Clone)]
pub struct AcceptBackoff {
    next: Duration,
}

impl Default for AcceptBackoff {
    fn default() -> Self {
        Self::new()
    }
}

const FIRST: Duration = Duration::from_millis(5);
const MAX: Duration = Duration::from_secs(1);

impl AcceptBackoff {
    /// A fresh loop.
    pub fn new() -> Self {
        AcceptBackoff { next: FIRST }
    }

    /// Call after every successful accept.
    pub fn reset(&mut self) {
        self.next = FIRST;
    }

    /// Classifies `e` and, for resource errors, returns the wait and
    /// doubles the next one.
    pub fn on_error(&mut self, e: &io::Error) -> AcceptAction {
        match e.raw_os_error() {
            Some(
                libc::ECONNABORTED
                | libc::EPROTO
                | libc::ECONNRESET
                | libc::EINTR
                | libc::EAGAIN
                | libc::EPERM
                | libc::ENETDOWN
                | libc::ENOPROTOOPT
                | libc::EHOSTDOWN
                | libc::ENONET
                | libc::EHOSTUNREACH
                | libc::EOPNOTSUPP
                | libc::ENETUNREACH
                | libc::ETIMEDOUT,
            ) => AcceptAction::Retry,
            Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM) => {
                let wait = self.next;
                self.next = (self.next * 2).min(MAX);
                AcceptAction::Wait(wait)
            }
            Some(libc::EBADF | libc::EINVAL | libc::ENOTSOCK | libc::EFAULT) => AcceptAction::Fatal,
            // Unknown: assume transient, but never spin.
            _ => {
                let wait = self.next;
                self.next = (self.next * 2).min(MAX);
                AcceptAction::Wait(wait)
            }
        }
    }

    /// Handles an accept error in an async loop: logs it, sleeps if asked;
    /// returns false when the loop should stop.
    pub async fn handle(&mut self, what: &str, e: &io::Error) -> bool {
        match self.on_error(e) {
            AcceptAction::Retry => {
                tracing::debug!(server = what, error = %e, "accept failed for one connection");
                true
            }
            AcceptAction::Wait(d) => {
                tracing::warn!(server = what, error = %e, wait_ms = d.as_millis() as u64, "accept failed; backing off");
                tokio::time::sleep(d).await;
                true
            }
            AcceptAction::Fatal => {
                tracing::error!(server = what, error = %e, "listener unusable; stopping");
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_are_classified_and_backoff_grows_then_resets() {
        let mut b = AcceptBackoff::new();
        let e = |n| io::Error::from_raw_os_error(n);
        assert_eq!(b.on_error(&e(libc::ECONNABORTED)), AcceptAction::Retry);
        assert_eq!(b.on_error(&e(libc::EMFILE)), AcceptAction::Wait(FIRST));
        assert_eq!(b.on_error(&e(libc::ENFILE)), AcceptAction::Wait(FIRST * 2));
        for _ in 0..20 {
            b.on_error(&e(libc::EMFILE));
        }
        assert_eq!(b.on_error(&e(libc::EMFILE)), AcceptAction::Wait(MAX));
        b.reset();
        assert_eq!(b.on_error(&e(libc::ENOBUFS)), AcceptAction::Wait(FIRST));
        assert_eq!(b.on_error(&e(libc::EBADF)), AcceptAction::Fatal);
    }
}
