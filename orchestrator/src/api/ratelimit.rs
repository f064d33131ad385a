// SPDX-License-Identifier: Apache-2.0
//! Per-client limits of the API server, keyed by the client's IP address:
//! a token bucket of requests (a flood from one client gets 429 with
//! `Retry-After` while other clients are served), and a cap of failed
//! authentications per minute (token guessing gets 429, not more 401s).
//! A valid token is never locked out by someone else's failures: it is
//! checked before the failure cap applies.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The address of the client a request came from (inserted per connection
/// by the server; requests without it — in-process routers — are not limited).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClientAddr(pub IpAddr);

/// Per-client limits; a zero field turns its limit off.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RateLimits {
    /// Sustained requests per second per client.
    pub requests_per_sec: f64,
    /// Requests a client may send at once above the sustained rate.
    pub burst: f64,
    /// Failed authentications per client per minute before 429.
    pub failed_auth_per_min: u32,
}

impl Default for RateLimits {
    /// 2,000 requests/s with a burst of 4,000 (far above what kubectl, the
    /// controllers or a node agent send; every node of a one-machine
    /// cluster shares 127.0.0.1), 60 failed authentications a minute.
    fn default() -> Self {
        Self {
            requests_per_sec: 2000.0,
            burst: 4000.0,
            failed_auth_per_min: 60,
        }
    }
}

/// Most clients tracked at once; past it, idle entries are dropped.
const MAX_CLIENTS: usize = 65_536;
const AUTH_WINDOW: Duration = Duration::from_secs(60);

#[derive(Debug)]
struct Client {
    tokens: f64,
    last: Instant,
    auth_failures: u32,
    auth_window_start: Instant,
}

/// The limiter's state, shared by every connection.
#[derive(Debug)]
pub struct ClientLimiter {
    limits: RateLimits,
    clients: Mutex<HashMap<IpAddr, Client>>,
}

/// A refusal: how long the client should wait.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Throttled {
    /// Seconds to put in `Retry-After` (at least 1).
    pub retry_after_secs: u64,
}

impl ClientLimiter {
    /// A limiter with `limits`.
    pub fn new(limits: RateLimits) -> Self {
        Self {
            limits,
            clients: Mutex::new(HashMap::new()),
        }
    }

    fn with_client<T>(&self, ip: IpAddr, now: Instant, f: impl FnOnce(&mut Client) -> T) -> T {
        let mut m = self.clients.lock().unwrap_or_else(|e| e.into_inner());
        if m.len() >= MAX_CLIENTS && !m.contains_key(&ip) {
            // Keep memory bounded under a spoofed-address flood: forget
            // clients whose bucket has refilled (they lose nothing).
            let full = self.limits.burst;
            let rate = self.limits.requests_per_sec;
            m.retain(|_, c| {
                let refilled = c.tokens + now.duration_since(c.last).as_secs_f64() * rate;
                let locked =
                    c.auth_failures > 0 && now.duration_since(c.auth_window_start) < AUTH_WINDOW;
                refilled < full || locked
            });
            if m.len() >= MAX_CLIENTS {
                m.clear();
            }
        }
        let c = m.entry(ip).or_insert(Client {
            tokens: self.limits.burst,
            last: now,
            auth_failures: 0,
            auth_window_start: now,
        });
        f(c)
    }

    /// Takes one request from `ip`'s bucket.
    pub fn request(&self, ip: IpAddr) -> Result<(), Throttled> {
        self.request_at(ip, Instant::now())
    }

    fn request_at(&self, ip: IpAddr, now: Instant) -> Result<(), Throttled> {
        let RateLimits {
            requests_per_sec: rate,
            burst,
            ..
        } = self.limits;
        if rate <= 0.0 {
            return Ok(());
        }
        self.with_client(ip, now, |c| {
            let elapsed = now.saturating_duration_since(c.last).as_secs_f64();
            c.tokens = (c.tokens + elapsed * rate).min(burst.max(1.0));
            c.last = now;
            if c.tokens >= 1.0 {
                c.tokens -= 1.0;
                Ok(())
            } else {
                let wait = ((1.0 - c.tokens) / rate).ceil().max(1.0);
                Err(Throttled {
                    retry_after_secs: wait as u64,
                })
            }
        })
    }

    /// Whether `ip` may try to authenticate again (it has not failed too
    /// often in the current minute).
    pub fn auth_allowed(&self, ip: IpAddr) -> Result<(), Throttled> {
        self.auth_check_at(ip, Instant::now(), false)
    }

    /// Records a failed authentication from `ip`.
    pub fn auth_failed(&self, ip: IpAddr) {
        let _ = self.auth_check_at(ip, Instant::now(), true);
    }

    fn auth_check_at(&self, ip: IpAddr, now: Instant, failed: bool) -> Result<(), Throttled> {
        let cap = self.limits.failed_auth_per_min;
        if cap == 0 {
            return Ok(());
        }
        self.with_client(ip, now, |c| {
            if now.saturating_duration_since(c.auth_window_start) >= AUTH_WINDOW {
                c.auth_window_start = now;
                c.auth_failures = 0;
            }
            if failed {
                c.auth_failures = c.auth_failures.saturating_add(1);
            }
            if c.auth_failures >= cap {
                let left =
                    AUTH_WINDOW.saturating_sub(now.saturating_duration_since(c.auth_window_start));
                Err(Throttled {
                    retry_after_secs: left.as_secs().max(1),
                })
            } else {
                Ok(())
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(n: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, n])
    }

    #[test]
    fn bucket_allows_the_burst_then_refills_at_the_rate() {
        let l = ClientLimiter::new(RateLimits {
            requests_per_sec: 10.0,
            burst: 5.0,
            failed_auth_per_min: 0,
        });
        let t0 = Instant::now();
        for _ in 0..5 {
            l.request_at(ip(1), t0).unwrap();
        }
        let e = l.request_at(ip(1), t0).unwrap_err();
        assert_eq!(e.retry_after_secs, 1);
        // Another client is not affected.
        l.request_at(ip(2), t0).unwrap();
        // 0.25 s later: 2.5 tokens back.
        let t1 = t0 + Duration::from_millis(250);
        l.request_at(ip(1), t1).unwrap();
        l.request_at(ip(1), t1).unwrap();
        assert!(l.request_at(ip(1), t1).is_err());
    }

    #[test]
    fn failed_auth_cap_resets_after_the_window() {
        let l = ClientLimiter::new(RateLimits {
            requests_per_sec: 0.0,
            burst: 0.0,
            failed_auth_per_min: 3,
        });
        let t0 = Instant::now();
        for _ in 0..2 {
            assert!(l.auth_check_at(ip(1), t0, true).is_ok());
        }
        let e = l.auth_check_at(ip(1), t0, true).unwrap_err();
        assert_eq!(e.retry_after_secs, 60);
        assert!(l.auth_check_at(ip(1), t0, false).is_err());
        assert!(l.auth_check_at(ip(2), t0, false).is_ok());
        assert!(l.auth_check_at(ip(1), t0 + AUTH_WINDOW, false).is_ok());
    }

    #[test]
    fn zero_limits_are_off() {
        let l = ClientLimiter::new(RateLimits {
            requests_per_sec: 0.0,
            burst: 0.0,
            failed_auth_per_min: 0,
        });
        for _ in 0..10_000 {
            l.request(ip(1)).unwrap();
            l.auth_failed(ip(1));
        }
        assert!(l.auth_allowed(ip(1)).is_ok());
    }

    #[test]
    fn client_table_stays_bounded() {
        let l = ClientLimiter::new(RateLimits::default());
        let t0 = Instant::now();
        for i in 0..(MAX_CLIENTS as u32 + 10) {
            let a = IpAddr::from(std::net::Ipv4Addr::from(i));
            l.request_at(a, t0).unwrap();
        }
        let n = l.clients.lock().unwrap().len();
        assert!(n <= MAX_CLIENTS, "{n}");
    }
}
