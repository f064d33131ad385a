// SPDX-License-Identifier: Apache-2.0
//! Leader election on a `coordination.k8s.io/v1` Lease, as client-go's
//! `leaderelection` package does it for kube-controller-manager: every
//! control plane serves the API, exactly one runs the controllers.
//!
//! ```text
//!  candidate ── get Lease ──┬─ absent ─────────────── create (holder = me) ─┐
//!     ▲                     ├─ holder = me / "" ───── update (rv compare) ──┤ won
//!     │                     └─ other holder: expired? ─ yes: take over ─────┘
//!     │                          (no change seen for leaseDuration)          │
//!     │                                                                      ▼
//!     └──── step down: controllers stopped ◄── no renew for renewDeadline ── leader
//!                                                  (renew every retryPeriod)
//! ```
//!
//! Safety rests on two clocks that only measure intervals (no wall-clock
//! agreement between hosts is needed): a candidate takes over only after it
//! has seen the record unchanged for `leaseDuration`, counted from when it
//! *observed* the record; the leader stops its controllers once
//! `renewDeadline` (< `leaseDuration`) has passed since it *sent* its last
//! successful renew, which is before any candidate observed it. Every write
//! is a compare-and-swap on the Lease's resourceVersion, so two candidates
//! never both win. Like Kubernetes, this bounds but does not fence writes a
//! stopping leader has already sent.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use tokio::sync::watch;

use crate::store::{Store, StoreError, StoreExt, UpdateScope};

/// Starts the work a leader does; returns what stops it.
pub type StartLeading = Arc<dyn Fn() -> Box<dyn FnOnce() + Send> + Send + Sync>;

/// Settings of one election (client-go's `LeaderElectionConfig`).
#[derive(Clone, Debug)]
pub struct LeaderElectionConfig {
    /// Namespace of the Lease.
    pub namespace: String,
    /// Name of the Lease.
    pub name: String,
    /// This candidate's identity (unique per process).
    pub identity: String,
    /// How long a candidate waits, after it last saw the Lease change,
    /// before it takes over (kube-controller-manager: 15 s).
    pub lease_duration: Duration,
    /// How long the leader keeps leading without a successful renew
    /// (kube-controller-manager: 10 s); less than `lease_duration`.
    pub renew_deadline: Duration,
    /// Time between attempts to acquire or renew (2 s).
    pub retry_period: Duration,
}

impl LeaderElectionConfig {
    /// The Lease `kube-system/sheaf-controller-manager` with
    /// kube-controller-manager's timings and a fresh identity
    /// (`<hostname>_<random>`).
    pub fn new() -> Self {
        LeaderElectionConfig {
            namespace: "kube-system".into(),
            name: "sheaf-controller-manager".into(),
            identity: default_identity(),
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
        }
    }

    /// Checks the timings and names.
    pub fn validate(&self) -> Result<(), String> {
        if self.name.is_empty() || self.namespace.is_empty() || self.identity.is_empty() {
            return Err("leader election needs a lease namespace, name and identity".into());
        }
        if self.identity.len() > crate::resources::coordination::MAX_HOLDER_IDENTITY {
            return Err(format!(
                "leader election identity is longer than {} bytes",
                crate::resources::coordination::MAX_HOLDER_IDENTITY
            ));
        }
        if self.retry_period.is_zero() {
            return Err("leader election retry period must be > 0".into());
        }
        if self.renew_deadline <= self.retry_period {
            return Err(format!(
                "leader election renew deadline ({:?}) must be longer than the retry period ({:?})",
                self.renew_deadline, self.retry_period
            ));
        }
        if self.lease_duration <= self.renew_deadline {
            return Err(format!(
                "leader election lease duration ({:?}) must be longer than the renew deadline ({:?})",
                self.lease_duration, self.renew_deadline
            ));
        }
        Ok(())
    }
}

impl Default for LeaderElectionConfig {
    fn default() -> Self {
        Self::new()
    }
}

/// `<hostname>_<16 random hex digits>`.
pub fn default_identity() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "sheaf".into());
    let mut b = [0u8; 8];
    let suffix = match sheaf_blockrepl::net::random_bytes(&mut b) {
        Ok(()) => b.iter().map(|x| format!("{x:02x}")).collect::<String>(),
        Err(_) => format!("{:x}", std::process::id()),
    };
    format!("{host}_{suffix}")
}

/// What the election looks like from this candidate.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LeaderStatus {
    /// Whether this candidate leads (runs the controllers) now.
    pub leading: bool,
    /// The holder of the Lease as last read ("" if none).
    pub holder: String,
}

/// A running election; dropping it without [`LeaderElection::shutdown`]
/// aborts it without releasing the Lease (as a crash would).
#[derive(Debug)]
pub struct LeaderElection {
    identity: String,
    status: watch::Receiver<LeaderStatus>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
    terms: Arc<AtomicU64>,
}

impl LeaderElection {
    /// Starts campaigning. `start` runs each time this candidate becomes
    /// leader; what it returns is called when it stops leading.
    pub fn spawn(
        store: Arc<dyn Store>,
        config: LeaderElectionConfig,
        start: StartLeading,
    ) -> Result<LeaderElection, String> {
        config.validate()?;
        let (tx, rx) = watch::channel(LeaderStatus::default());
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel();
        let terms = Arc::new(AtomicU64::new(0));
        let identity = config.identity.clone();
        let elector = Elector {
            store,
            config,
            observed: None,
            status: tx,
            terms: terms.clone(),
        };
        let task = tokio::spawn(elector.run(start, stop_rx));
        Ok(LeaderElection {
            identity,
            status: rx,
            stop: Some(stop_tx),
            task: Some(task),
            terms,
        })
    }

    /// This candidate's identity.
    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// Whether this candidate leads now.
    pub fn is_leader(&self) -> bool {
        self.status.borrow().leading
    }

    /// The election as this candidate sees it.
    pub fn status(&self) -> LeaderStatus {
        self.status.borrow().clone()
    }

    /// Changes of [`LeaderElection::status`].
    pub fn subscribe(&self) -> watch::Receiver<LeaderStatus> {
        self.status.clone()
    }

    /// How many times this candidate has become leader.
    pub fn terms(&self) -> u64 {
        self.terms.load(Ordering::Relaxed)
    }

    /// Stops campaigning: a leader stops its work and releases the Lease
    /// (holder cleared), so another candidate takes over at its next retry
    /// instead of after a whole lease duration.
    pub async fn shutdown(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
    }
}

impl Drop for LeaderElection {
    fn drop(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}

struct Elector {
    store: Arc<dyn Store>,
    config: LeaderElectionConfig,
    /// The Lease's resourceVersion as last read, and when it was first seen.
    observed: Option<(String, Instant)>,
    status: watch::Sender<LeaderStatus>,
    terms: Arc<AtomicU64>,
}

/// Result of one attempt.
enum Attempt {
    /// This candidate holds the Lease (acquired or renewed).
    Held,
    /// Another candidate holds it.
    Other(String),
}

fn now() -> MicroTime {
    MicroTime(jiff::Timestamp::now())
}

fn secs_ceil(d: Duration) -> i32 {
    i32::try_from(d.as_millis().div_ceil(1000))
        .unwrap_or(i32::MAX)
        .max(1)
}

impl Elector {
    fn set_status(&self, leading: bool, holder: &str) {
        self.status.send_if_modified(|s| {
            let changed = s.leading != leading || s.holder != holder;
            s.leading = leading;
            s.holder = holder.to_string();
            changed
        });
    }

    /// client-go's `tryAcquireOrRenew`.
    async fn try_acquire_or_renew(&mut self) -> Result<Attempt, StoreError> {
        let me = self.config.identity.clone();
        let ns = self.config.namespace.clone();
        let name = self.config.name.clone();
        let spec = |acquire: MicroTime, transitions: i32| LeaseSpec {
            holder_identity: Some(me.clone()),
            lease_duration_seconds: Some(secs_ceil(self.config.lease_duration)),
            acquire_time: Some(acquire),
            renew_time: Some(now()),
            lease_transitions: Some(transitions),
            ..Default::default()
        };
        let current: Lease = match self.store.get_typed(&ns, &name).await {
            Ok(l) => l,
            Err(StoreError::NotFound { .. }) => {
                let lease = Lease {
                    metadata: ObjectMeta {
                        name: Some(name.clone()),
                        namespace: Some(ns.clone()),
                        ..Default::default()
                    },
                    spec: Some(spec(now(), 0)),
                };
                return match self.store.create_typed(&lease).await {
                    Ok(_) => Ok(Attempt::Held),
                    Err(StoreError::AlreadyExists { .. }) => Ok(Attempt::Other(String::new())),
                    Err(e) => Err(e),
                };
            }
            Err(e) => return Err(e),
        };
        let rv = current
            .metadata
            .resource_version
            .clone()
            .unwrap_or_default();
        let observed_at = match &self.observed {
            Some((seen, at)) if *seen == rv => *at,
            _ => {
                let at = Instant::now();
                self.observed = Some((rv, at));
                at
            }
        };
        let old = current.spec.clone().unwrap_or_default();
        let holder = old.holder_identity.clone().unwrap_or_default();
        let duration = Duration::from_secs(
            u64::try_from(old.lease_duration_seconds.unwrap_or(0)).unwrap_or(0),
        );
        if !holder.is_empty() && holder != me && observed_at.elapsed() < duration {
            return Ok(Attempt::Other(holder));
        }
        let (acquire, transitions) = if holder == me {
            (
                old.acquire_time.unwrap_or_else(now),
                old.lease_transitions.unwrap_or(0),
            )
        } else {
            (now(), old.lease_transitions.unwrap_or(0).saturating_add(1))
        };
        let mut next = current;
        next.spec = Some(spec(acquire, transitions));
        match self.store.update_typed(&next, UpdateScope::All).await {
            Ok(_) => Ok(Attempt::Held),
            Err(StoreError::Conflict { .. }) | Err(StoreError::NotFound { .. }) => {
                Ok(Attempt::Other(holder))
            }
            Err(e) => Err(e),
        }
    }

    /// One attempt, bounded by `limit` (a store that hangs counts as failed).
    async fn attempt(&mut self, limit: Duration) -> Option<Attempt> {
        match tokio::time::timeout(limit, self.try_acquire_or_renew()).await {
            Ok(Ok(a)) => Some(a),
            Ok(Err(e)) => {
                tracing::warn!(lease = %self.config.name, error = %e, "leader election: store call failed");
                None
            }
            Err(_) => {
                tracing::warn!(lease = %self.config.name, "leader election: store call timed out");
                None
            }
        }
    }

    /// Clears the holder if this candidate still holds the Lease.
    async fn release(&mut self) {
        let (ns, name) = (self.config.namespace.clone(), self.config.name.clone());
        let me = self.config.identity.clone();
        let res = tokio::time::timeout(self.config.renew_deadline, async {
            let mut lease: Lease = self.store.get_typed(&ns, &name).await?;
            let Some(spec) = lease.spec.as_mut() else {
                return Ok(());
            };
            if spec.holder_identity.as_deref() != Some(me.as_str()) {
                return Ok(());
            }
            spec.holder_identity = None;
            spec.lease_duration_seconds = Some(1);
            spec.renew_time = Some(now());
            self.store
                .update_typed(&lease, UpdateScope::All)
                .await
                .map(|_| ())
        })
        .await;
        match res {
            Ok(Ok(())) => tracing::info!(lease = %name, identity = %me, "released leadership"),
            Ok(Err(e)) => tracing::warn!(lease = %name, error = %e, "releasing the lease failed"),
            Err(_) => tracing::warn!(lease = %name, "releasing the lease timed out"),
        }
    }

    async fn run(mut self, start: StartLeading, mut stop: tokio::sync::oneshot::Receiver<()>) {
        let retry = self.config.retry_period;
        loop {
            // Candidate: try every retry period until this one holds the Lease.
            let won_at = loop {
                let t = Instant::now();
                match self.attempt(self.config.renew_deadline).await {
                    Some(Attempt::Held) => break t,
                    Some(Attempt::Other(holder)) => self.set_status(false, &holder),
                    None => {}
                }
                tokio::select! {
                    _ = &mut stop => return,
                    _ = tokio::time::sleep(jitter(retry)) => {}
                }
            };
            self.terms.fetch_add(1, Ordering::Relaxed);
            tracing::info!(lease = %self.config.name, identity = %self.config.identity, "became leader");
            let me = self.config.identity.clone();
            self.set_status(true, &me);
            let work = StopGuard(Some(start()));
            // Leader: renew every retry period; step down when the last
            // successful renew was sent more than renew_deadline ago.
            let mut last_renew = won_at;
            let released = loop {
                tokio::select! {
                    _ = &mut stop => break true,
                    _ = tokio::time::sleep(retry) => {}
                }
                let left = self
                    .config
                    .renew_deadline
                    .saturating_sub(last_renew.elapsed());
                if left.is_zero() {
                    break false;
                }
                let t = Instant::now();
                match self.attempt(left).await {
                    Some(Attempt::Held) => last_renew = t,
                    Some(Attempt::Other(holder)) => {
                        tracing::warn!(lease = %self.config.name, %holder, "lost the lease to another candidate");
                        self.set_status(false, &holder);
                        break false;
                    }
                    None => {}
                }
                if last_renew.elapsed() >= self.config.renew_deadline {
                    break false;
                }
            };
            drop(work);
            if released {
                self.release().await;
                self.set_status(false, "");
                return;
            }
            tracing::warn!(
                lease = %self.config.name,
                identity = %self.config.identity,
                "stopped leading (no renew within the renew deadline)"
            );
            let holder = self.status.borrow().holder.clone();
            let holder = if holder == me { String::new() } else { holder };
            self.set_status(false, &holder);
        }
    }
}

/// Stops the leader's work when dropped: on step-down, and also when the
/// election task is aborted, so no work outlives its election.
struct StopGuard(Option<Box<dyn FnOnce() + Send>>);

impl Drop for StopGuard {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            f();
        }
    }
}

/// `d` plus up to 20 % (client-go's `JitterFactor` 1.2), so candidates that
/// started together do not retry in lockstep.
fn jitter(d: Duration) -> Duration {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|t| t.subsec_nanos())
        .unwrap_or(0);
    d + d.mul_f64(f64::from(nanos % 1000) / 5000.0)
}

#[cfg(test)]
#[path = "leader_tests.rs"]
mod tests;
